"""Open-loop arrivals: seeded, at the asked mean rate, with the asked burstiness (the gamma
shape: the gaps' coefficient of variation is 1 / sqrt(shape))."""

from __future__ import annotations

import math
import statistics
from itertools import islice

import pytest

from loadtest.arrivals import gaps, start_times

N = 20_000


def test_same_seed_same_times() -> None:
    a = list(islice(start_times(5.0, 1.0, seed=7), 100))
    b = list(islice(start_times(5.0, 1.0, seed=7), 100))
    c = list(islice(start_times(5.0, 1.0, seed=8), 100))
    assert a == b and a != c
    assert a[0] == 0.0 and a == sorted(a)


@pytest.mark.parametrize("rate", [0.5, 4.0, 100.0])
def test_poisson_mean_rate(rate: float) -> None:
    drawn = list(islice(gaps(rate, 1.0, seed=1), N))
    # the mean of N exponential gaps is within 4 standard errors (1 / rate / sqrt(N))
    assert abs(statistics.fmean(drawn) - 1 / rate) < 4 / rate / math.sqrt(N)
    # exponential: the standard deviation equals the mean
    assert statistics.pstdev(drawn) == pytest.approx(1 / rate, rel=0.05)


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_gamma_burstiness(burstiness: float) -> None:
    drawn = list(islice(gaps(2.0, burstiness, seed=3), N))
    assert statistics.fmean(drawn) == pytest.approx(0.5, rel=0.05)  # the rate is kept
    cv = statistics.pstdev(drawn) / statistics.fmean(drawn)
    assert cv == pytest.approx(1 / math.sqrt(burstiness), rel=0.08)


def test_infinite_rate_sends_all_at_once() -> None:
    assert list(islice(start_times(math.inf), 5)) == [0.0] * 5


@pytest.mark.parametrize(("rate", "burstiness"), [(0.0, 1.0), (-1.0, 1.0), (1.0, 0.0)])
def test_refuses_non_positive(rate: float, burstiness: float) -> None:
    with pytest.raises(ValueError):
        next(gaps(rate, burstiness))

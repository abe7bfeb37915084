"""The load test's figures on hand-made arrival times (binary fractions, so exact)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from loadtest.metrics import (
    RequestRecord,
    e2e,
    itls,
    meets_slos,
    percentile,
    run_figures,
    summarize,
    tpot,
    ttft,
)
from loadtest.targets import share_tokens


def speculative() -> RequestRecord:
    """5 tokens: 1 at 0.25 s, 3 together at 0.625 s, 1 at 0.75 s; the stream ends at 1 s."""
    return RequestRecord(start=0.0, chunks=[(0.25, 1), (0.625, 3), (0.75, 1)], end=1.0)


def test_one_request() -> None:
    r = speculative()
    assert r.num_output_tokens == 5
    assert ttft(r) == 0.25
    assert e2e(r) == 1.0
    assert tpot(r) == (1.0 - 0.25) / 4 == 0.1875
    # the 3-token chunk's 0.375 s gap is shared among its tokens
    assert itls(r) == [0.125, 0.125, 0.125, 0.125]


def test_first_chunk_of_several_tokens_has_no_itl() -> None:
    r = RequestRecord(start=1.0, chunks=[(1.5, 4), (2.0, 2)], end=2.0)
    assert ttft(r) == 0.5
    assert itls(r) == [0.25, 0.25]
    assert tpot(r) == 0.5 / 5


def test_one_token_has_no_tpot() -> None:
    r = RequestRecord(start=0.0, chunks=[(0.5, 1)], end=0.5)
    assert tpot(r) is None and itls(r) == []
    assert meets_slos(r, {"tpot_ms": 1.0, "ttft_ms": 500.0})
    assert not meets_slos(r, {"ttft_ms": 499.0})


def test_percentile_is_numpy_linear() -> None:
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 90) == 4.6
    assert percentile([7.0], 99) == 7.0
    rng = random.Random(0)
    values = [rng.random() for _ in range(101)]
    for q in (0, 50, 90, 99, 100):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)), abs=1e-15)


def test_summarize_in_ms_and_empty() -> None:
    assert summarize([0.25, 0.5, 0.75, 1.0]) == {
        "mean": 625.0,
        "p50": 625.0,
        "p90": 925.0,
        "p99": 992.5,
    }
    assert summarize([]) == {"mean": None, "p50": None, "p90": None, "p99": None}


def test_run_figures() -> None:
    slow = RequestRecord(start=0.0, chunks=[(1.0, 1), (1.5, 1)], end=1.5)  # TTFT 1 s
    failed = RequestRecord(start=0.0, error="UNAVAILABLE")
    refused = RequestRecord(start=0.0, error="429")
    also_refused = RequestRecord(start=0.0, error="429")
    records = [speculative(), slow, failed, refused, also_refused]
    figures = run_figures(records, duration_s=2.0, slos={"ttft_ms": 500.0, "tpot_ms": 200.0})
    assert figures["num_requests"] == 5
    assert figures["num_completed"] == 2 and figures["num_failed"] == 3
    assert figures["errors"] == {"429": 2, "UNAVAILABLE": 1}
    assert figures["num_output_tokens"] == 7
    assert figures["request_throughput"] == 1.0
    assert figures["output_throughput"] == 3.5
    assert figures["num_good"] == 1 and figures["goodput"] == 0.5  # slow misses the TTFT SLO
    ttft_ms = figures["ttft_ms"]  # of 250 and 1000 ms
    assert (ttft_ms["mean"], ttft_ms["p50"], ttft_ms["p90"]) == (625.0, 625.0, 925.0)
    assert ttft_ms["p99"] == pytest.approx(992.5, abs=1e-9)
    assert figures["tpot_ms"]["mean"] == (187.5 + 500.0) / 2
    assert figures["itl_ms"]["p50"] == 125.0 and figures["itl_ms"]["mean"] == 200.0
    assert figures["e2e_ms"]["mean"] == 1250.0
    # without SLOs every completed request is good
    assert run_figures(records, 2.0, {})["goodput"] == 1.0


def test_http_usage_shared_among_events() -> None:
    events = [(0.5, 1), (0.75, 1), (1.0, 1)]
    assert share_tokens(events, 3) == events
    assert share_tokens(events, 7) == [(0.5, 2), (0.75, 2), (1.0, 3)]
    assert share_tokens([], 4) == []

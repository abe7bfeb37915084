"""The load's shape against a fake target (no server): the count and duration bounds, the
concurrency cap (a closed loop keeps it full), open-loop starts at the drawn times, and
warm-up requests outside the records."""

from __future__ import annotations

import asyncio
import math
import time
from itertools import islice, repeat

import pytest

from loadtest.arrivals import start_times
from loadtest.data import RequestSpec
from loadtest.metrics import RequestRecord
from loadtest.runner import LoadShape, run_load, warm_up

SPEC = RequestSpec(prompt=[5, 6, 7], output_len=3)


class FakeTarget:
    """Answers each request with ``output_len`` one-token chunks ``step_s`` apart."""

    name = "fake"
    model = "fake"

    def __init__(self, step_s: float = 0.01) -> None:
        self.step_s = step_s
        self.num_sent = 0
        self.in_flight = 0
        self.max_in_flight = 0

    async def check(self) -> None:
        pass

    async def send(self, spec: RequestSpec, record: RequestRecord, *, ignore_eos: bool) -> None:
        self.num_sent += 1
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        for _ in range(spec.output_len):
            await asyncio.sleep(self.step_s)
            record.chunks.append((time.perf_counter(), 1))
        record.end = time.perf_counter()
        self.in_flight -= 1

    async def close(self) -> None:
        pass


def shape(**fields: object) -> LoadShape:
    values: dict[str, object] = dict(
        rate=math.inf, burstiness=1.0, concurrency=None, num_requests=None, duration_s=None, seed=0
    )
    values.update(fields)
    return LoadShape(**values)  # type: ignore[arg-type]


async def test_closed_loop_keeps_concurrency_full() -> None:
    target = FakeTarget()
    result = await run_load(
        target, repeat(SPEC), shape(concurrency=3, num_requests=10), ignore_eos=True,
        show_progress=False,
    )  # fmt: skip
    assert len(result.records) == target.num_sent == 10
    assert all(r.is_ok and r.num_output_tokens == 3 for r in result.records)
    assert target.max_in_flight == 3
    # 10 requests of ~30 ms, 3 at a time: 4 rounds
    assert 0.12 <= result.duration_s < 0.5


async def test_unbounded_rate_sends_all_at_once() -> None:
    target = FakeTarget()
    await run_load(
        target, repeat(SPEC), shape(num_requests=8), ignore_eos=True, show_progress=False
    )
    assert target.max_in_flight == 8


async def test_open_loop_starts_at_the_drawn_times() -> None:
    target = FakeTarget(step_s=0.001)
    load = shape(rate=40.0, burstiness=1.0, num_requests=12, seed=3)
    result = await run_load(target, repeat(SPEC), load, ignore_eos=True, show_progress=False)
    starts = sorted(r.start for r in result.records)
    offsets = [s - starts[0] for s in starts]
    expected = list(islice(start_times(40.0, 1.0, seed=3), 12))
    assert offsets == pytest.approx(expected, abs=0.02)


async def test_duration_bound() -> None:
    target = FakeTarget(step_s=0.001)
    load = shape(rate=100.0, duration_s=0.3, seed=1)
    result = await run_load(target, repeat(SPEC), load, ignore_eos=True, show_progress=False)
    planned = [t for t in islice(start_times(100.0, seed=1), 1000) if t < 0.3]
    assert sorted(r.index for r in result.records) == list(range(len(planned)))
    # none early (a busy machine only makes them late, and late ones are still sent)
    assert all(r.start - result.start >= planned[r.index] - 0.005 for r in result.records)


async def test_a_closed_loop_starts_none_after_its_duration() -> None:
    target = FakeTarget(step_s=0.05)
    load = shape(concurrency=2, duration_s=0.2)
    result = await run_load(target, repeat(SPEC), load, ignore_eos=True, show_progress=False)
    # an endless supply of requests, yet it ends: 2 at once, 0.15 s each, for 0.2 s
    assert 2 <= len(result.records) <= 6 and target.max_in_flight == 2


async def test_warm_up_is_not_recorded() -> None:
    target = FakeTarget()
    requests = repeat(SPEC)
    await warm_up(target, requests, 4, concurrency=2, ignore_eos=True)
    assert target.num_sent == 4 and target.max_in_flight == 2
    result = await run_load(
        target, requests, shape(num_requests=5), ignore_eos=True, show_progress=False
    )
    assert len(result.records) == 5 and target.num_sent == 9


def test_shape_needs_a_bound() -> None:
    with pytest.raises(ValueError):
        shape()

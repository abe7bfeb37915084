"""The load itself: warm-up requests (not counted), then requests started at open-loop
arrival times (``loadtest.arrivals``) and/or kept at a fixed number in flight (closed
loop), until a count or a duration; each request's timings in a ``RequestRecord``."""

from __future__ import annotations

import asyncio
import math
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

from loadtest.arrivals import start_times
from loadtest.data import RequestSpec
from loadtest.metrics import RequestRecord
from loadtest.targets import Target


@dataclass(frozen=True)
class LoadShape:
    """How one run sends its requests."""

    rate: float  # requests per second on average; inf: no pacing (closed loop or all at once)
    burstiness: float  # the gamma shape of the gaps; 1 is Poisson
    concurrency: int | None  # at most this many in flight; None: no limit
    num_requests: int | None  # stop after this many (None: by duration only)
    # Start none planned after this many seconds (None: by count only). At a finite rate,
    # every arrival planned before it is sent, however late a busy machine or the
    # concurrency cap makes it; a closed loop (infinite rate) starts none after it.
    duration_s: float | None
    seed: int  # of the arrival times

    def __post_init__(self) -> None:
        if self.num_requests is None and self.duration_s is None:
            raise ValueError("a run needs a request count or a duration")


@dataclass
class RunResult:
    """One run's records and the seconds from its first start to its last end."""

    shape: LoadShape
    records: list[RequestRecord]
    duration_s: float
    start: float = 0.0  # when it began, on the records' clock


async def warm_up(
    target: Target, requests: Iterator[RequestSpec], num: int, concurrency: int | None, *,
    ignore_eos: bool,
) -> None:  # fmt: skip
    """Send ``num`` requests, at most ``concurrency`` at once, and wait for them: the server's
    first-request costs (compilation, lazy allocation) fall outside the measured run."""
    limit = asyncio.Semaphore(concurrency or max(num, 1))

    async def one(spec: RequestSpec) -> None:
        async with limit:
            await target.send(spec, RequestRecord(time.perf_counter()), ignore_eos=ignore_eos)

    await asyncio.gather(*(one(next(requests)) for _ in range(num)))


async def run_load(
    target: Target,
    requests: Iterator[RequestSpec],
    shape: LoadShape,
    *,
    ignore_eos: bool,
    show_progress: bool = True,
) -> RunResult:
    """Send requests as ``shape`` says and wait for every one that started."""
    from tqdm import tqdm  # the loadtest extra's (the command checks it is there)

    limit = asyncio.Semaphore(shape.concurrency) if shape.concurrency else None
    records: list[RequestRecord] = []
    tasks: list[asyncio.Task[None]] = []
    label = f"rate {shape.rate:g}/s" if math.isfinite(shape.rate) else "requests"
    if shape.concurrency:
        label += f", concurrency {shape.concurrency}"
    bar = tqdm(
        total=shape.num_requests, desc=label, unit="req", file=sys.stderr,
        disable=not show_progress,
    )  # fmt: skip

    async def one(index: int, spec: RequestSpec) -> None:
        record = RequestRecord(time.perf_counter(), index=index, max_tokens=spec.output_len)
        records.append(record)
        try:
            await target.send(spec, record, ignore_eos=ignore_eos)
        finally:
            if limit is not None:
                limit.release()
            bar.update(1)

    t0 = time.perf_counter()
    times = start_times(shape.rate, shape.burstiness, shape.seed)
    for i, (spec, at) in enumerate(zip(requests, times, strict=False)):
        if shape.num_requests is not None and i >= shape.num_requests:
            break
        if shape.duration_s is not None and at >= shape.duration_s:
            break
        delay = t0 + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if limit is not None:
            await limit.acquire()
        closed_loop = not math.isfinite(shape.rate)  # no planned times: the clock decides
        if (
            closed_loop
            and shape.duration_s is not None
            and time.perf_counter() - t0 >= shape.duration_s
        ):
            if limit is not None:
                limit.release()
            break
        tasks.append(asyncio.create_task(one(i, spec)))
        await asyncio.sleep(0)  # let it send before the next is paced
    await asyncio.gather(*tasks)
    bar.close()
    return RunResult(shape, records, time.perf_counter() - t0, t0)

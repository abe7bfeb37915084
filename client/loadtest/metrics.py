"""The figures of a load test, as pure functions of each request's timings.

Definitions (also in `tandem loadtest --help`):
- TTFT: first chunk's arrival minus the request's start.
- ITL (inter-token latency): the gap between one chunk and the one before it, shared evenly
  among the chunk's tokens (a chunk carries several tokens under speculative decoding): a
  chunk of 3 tokens 30 ms after the previous one gives three ITLs of 10 ms. The first
  chunk's tokens have none (their wait is the TTFT).
- TPOT (time per output token): (end-to-end - TTFT) / (tokens - 1), per request; requests
  of one token have none.
- End-to-end latency: the stream's end minus the request's start.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from loadtest.speculative import SpecCounts, total

SLO_KEYS = ("ttft_ms", "tpot_ms", "e2e_ms")  # what --slo accepts
PERCENTILES = (50, 90, 99)


@dataclass
class RequestRecord:
    """One request's timings, in seconds on one monotonic clock."""

    start: float  # when it was sent
    chunks: list[tuple[float, int]] = field(default_factory=list)  # (arrival, num_tokens)
    end: float | None = None  # when the stream ended; None while running or after an error
    error: str | None = None  # the status code ("UNAVAILABLE", "429") of a failed request
    prompt_tokens: int | None = None  # as the server's usage reports them, when it does
    speculative: SpecCounts | None = None  # the usage's speculative counters (gRPC, a draft)
    index: int = 0  # its place in the run's request stream (the seeded data's order)
    max_tokens: int | None = None  # what it asked for

    @property
    def is_ok(self) -> bool:
        return self.error is None and self.end is not None and bool(self.chunks)

    @property
    def num_output_tokens(self) -> int:
        return sum(n for _, n in self.chunks)


def ttft(record: RequestRecord) -> float:
    """Seconds from the start to the first chunk."""
    return record.chunks[0][0] - record.start


def e2e(record: RequestRecord) -> float:
    """Seconds from the start to the stream's end."""
    assert record.end is not None
    return record.end - record.start


def tpot(record: RequestRecord) -> float | None:
    """(end-to-end - TTFT) / (tokens - 1); None for a request of one token."""
    n = record.num_output_tokens
    if n < 2:
        return None
    return (e2e(record) - ttft(record)) / (n - 1)


def itls(record: RequestRecord) -> list[float]:
    """Each token's inter-token latency after the first chunk: a chunk's gap to the one
    before, divided evenly among its tokens."""
    out: list[float] = []
    for (before, _), (arrival, n) in zip(record.chunks, record.chunks[1:], strict=False):
        if n > 0:
            out.extend([(arrival - before) / n] * n)
    return out


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), interpolated linearly between the two nearest ranks
    (numpy's default method); NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(values: Sequence[float], scale: float = 1000.0) -> dict[str, float | None]:
    """Mean, p50, p90 and p99 of ``values`` times ``scale`` (seconds to ms by default);
    None for each when there are no values (JSON has no NaN)."""
    if not values:
        return {"mean": None, **{f"p{q}": None for q in PERCENTILES}}
    figures: dict[str, float | None] = {"mean": sum(values) / len(values) * scale}
    figures.update({f"p{q}": percentile(values, q) * scale for q in PERCENTILES})
    return figures


def meets_slos(record: RequestRecord, slos: Mapping[str, float]) -> bool:
    """Whether a completed request is within every SLO (``SLO_KEYS``, in ms); a request of
    one token has no TPOT and meets a TPOT SLO."""
    measured = {"ttft_ms": ttft(record), "e2e_ms": e2e(record), "tpot_ms": tpot(record)}
    for key, limit_ms in slos.items():
        value = measured[key]
        if value is not None and value * 1000 > limit_ms:
            return False
    return True


def run_figures(
    records: Sequence[RequestRecord], duration_s: float, slos: Mapping[str, float]
) -> dict[str, object]:
    """The figures of one run: counts, throughputs, goodput (requests per second meeting
    all ``slos``; all completed ones without SLOs), errors by status code, the latency
    summaries in ms, and the speculative counters of the completed requests' usage (None
    when none carried any)."""
    done = [r for r in records if r.is_ok]
    errors = Counter(r.error or "INCOMPLETE" for r in records if not r.is_ok)
    num_output_tokens = sum(r.num_output_tokens for r in done)
    num_good = sum(meets_slos(r, slos) for r in done)
    per_s = 1 / duration_s if duration_s > 0 else 0.0
    tpots = [t for t in (tpot(r) for r in done) if t is not None]
    spec = total(r.speculative for r in done)
    return {
        "num_requests": len(records),
        "num_completed": len(done),
        "num_failed": len(records) - len(done),
        "errors": dict(sorted(errors.items())),
        "num_output_tokens": num_output_tokens,
        "num_prompt_tokens": sum(r.prompt_tokens or 0 for r in done),
        "duration_s": duration_s,
        "request_throughput": len(done) * per_s,
        "output_throughput": num_output_tokens * per_s,
        "goodput": num_good * per_s,
        "num_good": num_good,
        "ttft_ms": summarize([ttft(r) for r in done]),
        "itl_ms": summarize([gap for r in done for gap in itls(r)]),
        "tpot_ms": summarize(tpots),
        "e2e_ms": summarize([e2e(r) for r in done]),
        "speculative": spec.figures("usage") if spec is not None else None,
    }

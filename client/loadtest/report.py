"""A load test's report: an aligned table per run for people, and one JSON object of the
figures (a list of runs, one per rate of a sweep) for scripts, printed last."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

LATENCIES = (("TTFT", "ttft_ms"), ("ITL", "itl_ms"), ("TPOT", "tpot_ms"), ("E2E", "e2e_ms"))


def describe_shape(run: Mapping[str, Any]) -> str:
    """How a run sent its requests, in words."""
    rate = run["request_rate"]
    is_paced = rate is not None and math.isfinite(rate)
    parts = [f"rate {rate:g}/s" if is_paced else "rate unlimited"]
    if run["burstiness"] != 1 and is_paced:
        parts.append(f"burstiness {run['burstiness']:g}")
    if run["concurrency"]:
        parts.append(f"concurrency {run['concurrency']}")
    return ", ".join(parts)


def table(run: Mapping[str, Any]) -> str:
    """One run's figures as aligned text."""

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f}"

    errors = ", ".join(f"{code}: {n}" for code, n in run["errors"].items())
    slos = ", ".join(f"{key} <= {limit:g}" for key, limit in run["slos"].items())
    lines = [
        f"== {describe_shape(run)} ==",
        f"completed {run['num_completed']}/{run['num_requests']} requests"
        f" in {run['duration_s']:.2f} s; failed {run['num_failed']}"
        + (f" ({errors})" if errors else ""),
        f"request throughput  {run['request_throughput']:10.2f} req/s",
        f"output throughput   {run['output_throughput']:10.2f} tok/s"
        f"  ({run['num_output_tokens']} tokens)",
        f"goodput             {run['goodput']:10.2f} req/s"
        f"  ({run['num_good']} requests within {slos or 'no SLOs'})",
        f"{'latency (ms)':<12}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}",
    ]
    for label, key in LATENCIES:
        f = run[key]
        lines.append(
            f"{label:<12}{ms(f['mean']):>10}{ms(f['p50']):>10}{ms(f['p90']):>10}{ms(f['p99']):>10}"
        )
    return "\n".join(lines)


def summary(target: Mapping[str, Any], runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The JSON object of a whole invocation: what was measured and each run's figures."""
    return {**target, "runs": list(runs)}


def to_json(obj: Any) -> str:
    """One line of JSON; infinities (an unlimited rate) as null."""

    def clean(value: Any) -> Any:
        if isinstance(value, float) and not math.isfinite(value):
            return None
        if isinstance(value, dict):
            return {k: clean(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [clean(v) for v in value]
        return value

    return json.dumps(clean(obj), separators=(",", ":"))

"""A load test's report: a summary screen for people (rich tables, on stderr), and one JSON
object of the figures (a list of runs, one per rate of a sweep) for scripts, printed last
on stdout."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # rich is the loadtest extra's: imported when a summary is shown
    from rich.console import Console
    from rich.table import Table

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


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _rate(run: Mapping[str, Any]) -> str:
    rate = run["request_rate"]
    return f"{rate:g}/s" if rate is not None and math.isfinite(rate) else "unlimited"


def summary_tables(target: str, runs: Sequence[Mapping[str, Any]]) -> list[Table]:
    """The end-of-run screen, one row per run (the rate of a sweep): counts, throughputs,
    goodput and accepted tokens per step; then latencies (mean, p50, p90, p99 in ms). What
    the runs share (concurrency, burstiness, SLOs) is said once, in the title."""
    from rich.table import Table

    first = runs[0]
    shared = [target]
    if first["concurrency"]:
        shared.append(f"concurrency {first['concurrency']}")
    if first["burstiness"] != 1:
        shared.append(f"burstiness {first['burstiness']:g}")
    slos = ", ".join(f"{key} <= {limit:g}" for key, limit in first["slos"].items())
    shared.append(f"SLOs {slos}" if slos else "no SLOs")
    figures = Table(title="; ".join(shared), title_justify="left")
    for column in ("rate", "completed", "failed", "req/s", "tok/s", "goodput", "acc/step"):
        figures.add_column(column, justify="left" if column in ("rate", "failed") else "right")
    latencies = Table(title="latency (ms)", title_justify="left")
    for column in ("rate", "", "mean", "p50", "p90", "p99"):
        latencies.add_column(column, justify="left" if column in ("rate", "") else "right")
    for i, run in enumerate(runs):
        errors = ", ".join(f"{code}: {n}" for code, n in run["errors"].items())
        accepted = (run.get("speculative") or {}).get("accepted_per_step")
        figures.add_row(
            _rate(run),
            f"{run['num_completed']}/{run['num_requests']} in {run['duration_s']:.2f} s",
            f"{run['num_failed']}" + (f" ({errors})" if errors else ""),
            f"{run['request_throughput']:.2f}",
            f"{run['output_throughput']:.1f}",
            f"{run['goodput']:.2f} ({run['num_good']})",
            "-" if accepted is None else f"{accepted:.2f}",
        )
        for j, (label, key) in enumerate(LATENCIES):
            f = run[key]
            latencies.add_row(
                _rate(run) if j == 0 else "", label,
                _ms(f["mean"]), _ms(f["p50"]), _ms(f["p90"]), _ms(f["p99"]),
                end_section=j == len(LATENCIES) - 1 and i < len(runs) - 1,
            )  # fmt: skip
    return [figures, latencies]


def print_summary(console: Console, title: str, runs: Sequence[Mapping[str, Any]]) -> None:
    """Print ``summary_tables`` to ``console`` (stderr in the command: stdout ends with the
    JSON line)."""
    for t in summary_tables(title, runs):
        console.print(t)


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

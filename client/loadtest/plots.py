"""A load test's PNG plots, with matplotlib (the loadtest extra's, imported only here, when
plots are written): the latency CDFs of every run, and for a sweep of two or more finite
rates its throughput and goodput against the offered rate."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from loadtest.metrics import RequestRecord, e2e, itls, ttft
from loadtest.report import describe_shape

CDF_FILE = "latency_cdf.png"
SWEEP_FILE = "throughput_vs_rate.png"


def write_plots(
    out_dir: Path, runs: Sequence[Mapping[str, Any]], records: Sequence[Sequence[RequestRecord]]
) -> list[Path]:
    """Write the plots of ``runs`` (their requests: ``records``) into ``out_dir``; the paths
    written."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    written = [_latency_cdfs(plt, out_dir / CDF_FILE, runs, records)]
    swept = [run for run in runs if run["request_rate"] is not None]
    swept = [run for run in swept if math.isfinite(run["request_rate"])]
    if len(swept) >= 2:
        written.append(_sweep(plt, out_dir / SWEEP_FILE, swept))
    return written


def _latency_cdfs(
    plt: Any,
    path: Path,
    runs: Sequence[Mapping[str, Any]],
    records: Sequence[Sequence[RequestRecord]],
) -> Path:
    """TTFT, ITL and E2E: one panel each, one empirical CDF per run."""
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5), constrained_layout=True)
    measures = (
        ("TTFT", lambda r: [ttft(r)]),
        ("ITL", itls),
        ("E2E latency", lambda r: [e2e(r)]),
    )
    for ax, (label, measure) in zip(axes, measures, strict=True):
        for run, run_records in zip(runs, records, strict=True):
            values = sorted(v * 1000 for r in run_records if r.is_ok for v in measure(r))
            if values:
                share = [(i + 1) / len(values) for i in range(len(values))]
                ax.step(values, share, where="post", label=describe_shape(run))
        ax.set_title(f"{label} CDF")
        ax.set_xlabel(f"{label} (ms)")
        ax.set_ylabel("share of requests" if label != "ITL" else "share of tokens")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize="small")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _sweep(plt: Any, path: Path, runs: Sequence[Mapping[str, Any]]) -> Path:
    """Request throughput and goodput (left axis) and output tokens per second (right) against
    the offered request rate."""
    ordered = sorted(runs, key=lambda run: run["request_rate"])
    rates = [run["request_rate"] for run in ordered]
    fig, ax = plt.subplots(figsize=(7, 4.5), constrained_layout=True)
    ax.plot(rates, [r["request_throughput"] for r in ordered], "o-", label="throughput (req/s)")
    ax.plot(rates, [r["goodput"] for r in ordered], "s--", label="goodput (req/s)")
    ax.plot(rates, rates, ":", color="grey", label="offered rate")
    ax.set_xlabel("offered request rate (req/s)")
    ax.set_ylabel("requests per second")
    ax.grid(alpha=0.3)
    tokens = ax.twinx()
    tokens.plot(
        rates, [r["output_throughput"] for r in ordered], "^-", color="tab:green",
        label="output throughput (tok/s)",
    )  # fmt: skip
    tokens.set_ylabel("output tokens per second")
    ax.set_ylim(bottom=0)
    tokens.set_ylim(bottom=0)
    lines = ax.get_legend_handles_labels()
    more = tokens.get_legend_handles_labels()
    ax.legend(lines[0] + more[0], lines[1] + more[1], fontsize="small", loc="upper left")
    ax.set_title("throughput and goodput against rate")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path

"""``bench/serving.py``'s plots, with matplotlib: each side's output throughput and TTFT p50
against the concurrency, and, for a rate sweep, its throughput and TTFT p50 against the
offered rate. One line per server, so that who wins where is seen at a glance."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

CONCURRENCY_FILE = "serving_vs_concurrency.png"
SWEEP_FILE = "serving_vs_rate.png"


def write_plots(
    out_dir: Path,
    result: Mapping[str, Any],
    sides: Sequence[str],
    levels: Sequence[int],
) -> list[Path]:
    """Writes the plots of one ``bench/serving.py`` run into ``out_dir``; the paths written.
    ``result`` is the run's JSON object (``<side>_tok_s_c<N>``, ``sweep``, ``setup``)."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    title = _title(result)
    fig, (tok_ax, ttft_ax) = plt.subplots(1, 2, figsize=(12, 4.5), constrained_layout=True)
    for side in sides:
        points = [
            (c, result[f"{side}_tok_s_c{c}"], result[f"{side}_ttft_ms_p50_c{c}"])
            for c in levels
            if result.get(f"{side}_tok_s_c{c}") is not None
        ]
        if not points:
            continue
        xs = [p[0] for p in points]
        tok_ax.plot(xs, [p[1] for p in points], marker="o", label=side, **_style(side))
        ttft_ax.plot(xs, [p[2] for p in points], marker="o", label=side, **_style(side))
    for ax, label in ((tok_ax, "output tokens/s"), (ttft_ax, "TTFT p50 (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(levels), [str(c) for c in levels])
        ax.set_xlabel("concurrency (requests in flight)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    tok_ax.set_title("throughput (higher is better)")
    ttft_ax.set_title("time to first token (lower is better)")
    fig.suptitle(title, fontsize=9)
    written = [out_dir / CONCURRENCY_FILE]
    fig.savefig(written[0], dpi=110)
    plt.close(fig)

    sweep: Mapping[str, Sequence[Mapping[str, Any]]] = result.get("sweep") or {}
    if any(len(runs) >= 2 for runs in sweep.values()):
        fig, (tok_ax, ttft_ax) = plt.subplots(1, 2, figsize=(12, 4.5), constrained_layout=True)
        for side, runs in sweep.items():
            rates = [run["rate"] for run in runs]
            tok_ax.plot(rates, [r["tok_s"] for r in runs], marker="o", label=side, **_style(side))
            ttft_ax.plot(
                rates, [r["ttft_ms_p50"] for r in runs], marker="o", label=side, **_style(side)
            )
        for ax, label in ((tok_ax, "output tokens/s"), (ttft_ax, "TTFT p50 (ms)")):
            ax.set_xlabel("offered rate (requests/s, Poisson)")
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        tok_ax.set_title("throughput against the offered rate")
        ttft_ax.set_title("time to first token against the offered rate")
        fig.suptitle(title, fontsize=9)
        written.append(out_dir / SWEEP_FILE)
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)
    return written


def _style(side: str) -> dict[str, Any]:
    """Tandem's sides solid, llama.cpp's dashed; EAGLE-3 sides with open markers."""
    style: dict[str, Any] = {"linestyle": "--" if side.startswith("llamacpp") else "-"}
    if side.endswith("eagle3"):
        style["markerfacecolor"] = "none"
    return style


def _title(result: Mapping[str, Any]) -> str:
    setup = result.get("setup") or {}
    return (
        f"{setup.get('model', '?')}, {setup.get('output_len', '?')} new tokens per request, "
        f"{setup.get('cores', '?')} cores"
    )

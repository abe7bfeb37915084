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
    by_concurrency = {
        side: [
            (c, result[f"{side}_tok_s_c{c}"], result[f"{side}_ttft_ms_p50_c{c}"])
            for c in levels
            if result.get(f"{side}_tok_s_c{c}") is not None
        ]
        for side in sides
    }
    written = [out_dir / CONCURRENCY_FILE]
    _pair(plt, written[0], by_concurrency, "concurrency (requests in flight)", title, levels)
    sweep: Mapping[str, Sequence[Mapping[str, Any]]] = result.get("sweep") or {}
    by_rate = {
        side: [(r["rate"], r["tok_s"], r["ttft_ms_p50"]) for r in runs]
        for side, runs in sweep.items()
    }
    if any(len(points) >= 2 for points in by_rate.values()):
        written.append(out_dir / SWEEP_FILE)
        _pair(plt, written[-1], by_rate, "offered rate (requests/s, Poisson)", title, None)
    return written


def _pair(
    plt: Any,
    path: Path,
    series: Mapping[str, Sequence[tuple[float, float, float]]],
    x_label: str,
    title: str,
    log2_ticks: Sequence[int] | None,
) -> None:
    """Two panels, output tok/s and TTFT p50, one line per side of (x, tok/s, TTFT) points;
    ``log2_ticks``: a log-2 x axis with those ticks (concurrency levels)."""
    fig, (tok_ax, ttft_ax) = plt.subplots(1, 2, figsize=(12, 4.5), constrained_layout=True)
    for side, points in series.items():
        if points:
            xs = [p[0] for p in points]
            tok_ax.plot(xs, [p[1] for p in points], marker="o", label=side, **_style(side))
            ttft_ax.plot(xs, [p[2] for p in points], marker="o", label=side, **_style(side))
    for ax, label in ((tok_ax, "output tokens/s"), (ttft_ax, "TTFT p50 (ms)")):
        if log2_ticks is not None:
            ax.set_xscale("log", base=2)
            ax.set_xticks(list(log2_ticks), [str(c) for c in log2_ticks])
        ax.set_xlabel(x_label)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    tok_ax.set_title("throughput (higher is better)")
    ttft_ax.set_title("time to first token (lower is better)")
    fig.suptitle(title, fontsize=9)
    fig.savefig(path, dpi=110)
    plt.close(fig)


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

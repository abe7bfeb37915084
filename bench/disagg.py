"""Disaggregated serving against its baselines, in one run.

1. KV transfer between two processes on this host (``bench/kv_transfer.py``, run as a
   child; its docstring says exactly what is measured): the gRPC transport, checksums
   included, vs a raw loopback socket (``sendall`` / ``recv_into`` pre-touched buffers)
   moving the same bytes; the shared-memory transport vs one ``tensor.copy_``.
2. Latency through the cluster (``tandem serve``: router, 1 prefill and 1 decode worker,
   embedded redis-server, loopback gRPC) vs the in-process engine, for the same prompts:
   time to first token (TTFT) and inter-token latency (ITL, a request's mean gap between
   tokens) at prompt lengths 128 and 2048 and concurrency 1 and 8.

Fairness: the cluster's processes share the cores (one torch thread each on 2 cores),
so the in-process engine runs with the same number of threads as one worker; both use
the same dtype, block size and KV budget, no drafter, greedy, ``--max-tokens`` each, and
both compile their decode steps (``--eager``: neither), warmed up alike. Prompts are
distinct windows of the committed held-out texts (no prefix-cache hits). The two sides
run in turn, ``--repeats`` times (5), each setting once per turn and the first side
alternating; a figure is the median over the turns of each run's median.

Prints a table per setting; the last line is one JSON object:
``{"grpc_gbps", "raw_socket_gbps", "grpc_ratio", "shm_gbps", "memcpy_gbps", "shm_ratio",
"ttft_overhead_ms_p50", "itl_overhead_ms_p50"}`` (overheads at prompt 128, concurrency
1), plus ``"latency"`` with every setting.

    python bench/disagg.py            # SmolLM2-135M bf16, prompts 128 and 2048
    python bench/disagg.py --quick    # prompts 128 and 512, fewer requests, 64 MiB pushes
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from serving.launcher import Cluster, ClusterSpec  # noqa: E402
from tandem_client.client import agenerate  # noqa: E402

KV_CACHE_MEMORY = 512 << 20


@dataclass
class Timing:
    """One request, seen by its client: when it was sent and when each token arrived."""

    sent: float
    arrivals: list[float]

    @property
    def ttft(self) -> float:
        return self.arrivals[0] - self.sent

    @property
    def itl(self) -> float:
        n = len(self.arrivals)
        return (self.arrivals[-1] - self.arrivals[0]) / (n - 1) if n > 1 else 0.0


def prompt_windows(model_dir: str, length: int, count: int) -> list[list[int]]:
    """``count`` distinct ``length``-token windows of the held-out chat and code texts."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    stream: list[int] = []
    for name in ("chat.jsonl", "code.jsonl"):
        for line in (ROOT / "training" / "heldout" / name).read_text().splitlines():
            stream += tokenizer.encode(json.loads(line)["prompt"], add_special_tokens=False)
    while len(stream) < length * count:
        stream += stream
    return [stream[i * length : (i + 1) * length] for i in range(count)]


def in_process_engine(model: str, dtype: str, threads: int, compiled: bool) -> LLMEngine:
    """The baseline: one engine in this process, warmed up as a worker's is (``compiled``:
    decode steps through torch.compile, as the cluster's decode worker runs them)."""
    return LLMEngine(
        EngineConfig(
            model=model,
            dtype=dtype,
            kv_cache_memory=KV_CACHE_MEMORY,
            num_threads=threads,
            torch_compile=compiled,
            warm_up=True,
        )
    )


def run_in_process(
    engine: LLMEngine, batches: list[list[list[int]]], max_tokens: int
) -> list[Timing]:
    """Each batch submitted at once, drained, then the next; token arrival = the end of
    the step that produced it."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    timings: list[Timing] = []
    for b, batch in enumerate(batches):
        now = time.perf_counter()
        mine = {f"{time.monotonic_ns()}-{b}-{i}": Timing(now, []) for i in range(len(batch))}
        for (rid, _), prompt in zip(mine.items(), batch, strict=True):
            engine.add_request(rid, prompt, params)
        while engine.has_unfinished_requests():
            outputs = engine.step()
            now = time.perf_counter()
            for out in outputs:
                timing = mine[out.request_id]
                timing.arrivals += [now] * (len(out.token_ids) - len(timing.arrivals))
        timings += mine.values()
    return timings


async def run_cluster(
    address: str, batches: list[list[list[int]]], max_tokens: int
) -> list[Timing]:
    async def one(prompt: list[int]) -> Timing:
        timing = Timing(time.perf_counter(), [])
        async for chunk in agenerate(
            address, prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True
        ):
            timing.arrivals += [time.perf_counter()] * len(chunk.token_ids)
        return timing

    await one([1] * 8)  # warm-up: channels; under one block, so nothing for prefix caching
    timings: list[Timing] = []
    for batch in batches:
        timings += await asyncio.gather(*(one(p) for p in batch))
    return timings


def medians(runs: list[dict[str, float]]) -> dict[str, float]:
    """Each figure's median over runs."""
    return {key: statistics.median(run[key] for run in runs) for key in runs[0]}


def summary(timings: list[Timing]) -> dict[str, float]:
    return {
        "ttft_ms_p50": 1e3 * statistics.median(t.ttft for t in timings),
        "itl_ms_p50": 1e3 * statistics.median(t.itl for t in timings),
    }


def transfer_figures(quick: bool) -> dict[str, float]:
    command = [sys.executable, str(ROOT / "bench" / "kv_transfer.py")]
    if quick:
        command.append("--quick")
    print("KV transfer:", " ".join(command[1:]), flush=True)
    done = subprocess.run(command, check=True, capture_output=True, text=True)
    print(done.stdout, end="", flush=True)
    figures: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2", help="prepared name or HF directory")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--max-tokens", type=int, default=32, help="new tokens per request")
    parser.add_argument("--quick", action="store_true", help="prompts 128 and 512, fewer runs")
    parser.add_argument("--skip-transfer", action="store_true", help="latency part only")
    parser.add_argument(
        "--repeats",
        type=int,
        default=5,
        help="alternating runs of the engine and the cluster; figures are medians (default 5)",
    )
    parser.add_argument(
        "--eager",
        action="store_true",
        help="the in-process engine and the cluster's workers both eager (default: both "
        "compile their decode steps, as `tandem serve` does; the first run compiles for "
        "minutes)",
    )
    args = parser.parse_args()

    from engine.model_store import resolve_model

    model = str(resolve_model(args.model))
    lengths = (128, 512) if args.quick else (128, 2048)
    rounds = {1: 3 if args.quick else 4, 8: 1}  # batches per concurrency
    settings = [(n, c) for n in lengths for c in rounds]
    per_run = sum(c * r for c, r in rounds.items())  # prompts of one side's run
    windows = {n: prompt_windows(model, n, 2 * args.repeats * per_run) for n in lengths}

    def batches_for(n: int, c: int, offset: int) -> list[list[list[int]]]:
        """Distinct prompts: each side's run takes windows of its own from ``offset``."""
        start = offset + sum(cc * rounds[cc] for cc in rounds if cc < c)
        flat = windows[n][start : start + c * rounds[c]]
        return [flat[i : i + c] for i in range(0, len(flat), c)]

    result: dict[str, object] = {}
    if not args.skip_transfer:
        result.update(transfer_figures(args.quick))

    spec = ClusterSpec(
        model=model,
        port=0,
        worker_args=("--dtype", args.dtype, "--kv-cache-memory", str(KV_CACHE_MEMORY)),
        service_args=("--log-level", "WARNING"),
        is_metrics_served=False,
        eager=args.eager,
    )
    threads = spec.threads_per_process()
    torch.set_num_threads(threads)
    print(f"in-process engine ({args.dtype}, {threads} thread(s)), then the cluster", flush=True)
    engine = in_process_engine(model, args.dtype, threads, compiled=not args.eager)
    # Alternating runs, each on prompts of its own; a figure is the median of the runs'
    # medians, so that drift on a shared machine hits both sides alike.
    ours: dict[tuple[int, int], list[dict[str, float]]] = {s: [] for s in settings}
    theirs: dict[tuple[int, int], list[dict[str, float]]] = {s: [] for s in settings}
    with Cluster(spec) as cluster:
        for r in range(args.repeats):
            for s in settings:
                mine, its = batches_for(*s, 2 * r * per_run), batches_for(*s, (2 * r + 1) * per_run)
                for side in ("cluster", "engine") if r % 2 else ("engine", "cluster"):  # ABBA
                    if side == "engine":
                        ours[s].append(summary(run_in_process(engine, mine, args.max_tokens)))
                    else:
                        timings = asyncio.run(
                            run_cluster(cluster.router_address, its, args.max_tokens)
                        )
                        theirs[s].append(summary(timings))
            print(f"run {r + 1} of {args.repeats} done", flush=True)
    ours_p50 = {s: medians(runs) for s, runs in ours.items()}
    theirs_p50 = {s: medians(runs) for s, runs in theirs.items()}
    rows = []
    print(
        f"\n{'prompt':>6} {'conc':>4} | {'TTFT ms engine':>14} {'cluster':>8} {'+':>7} | "
        f"{'ITL ms engine':>13} {'cluster':>8} {'+':>6}"
    )
    for n, c in settings:
        a, b = ours_p50[(n, c)], theirs_p50[(n, c)]
        row = {
            "prompt_len": n,
            "concurrency": c,
            "engine_ttft_ms": a["ttft_ms_p50"],
            "cluster_ttft_ms": b["ttft_ms_p50"],
            "engine_itl_ms": a["itl_ms_p50"],
            "cluster_itl_ms": b["itl_ms_p50"],
        }
        rows.append({k: round(v, 2) for k, v in row.items()})
        print(
            f"{n:>6} {c:>4} | {a['ttft_ms_p50']:>14.1f} {b['ttft_ms_p50']:>8.1f} "
            f"{b['ttft_ms_p50'] - a['ttft_ms_p50']:>7.1f} | {a['itl_ms_p50']:>13.2f} "
            f"{b['itl_ms_p50']:>8.2f} {b['itl_ms_p50'] - a['itl_ms_p50']:>6.2f}"
        )
    base = (lengths[0], 1)
    result["ttft_overhead_ms_p50"] = round(
        theirs_p50[base]["ttft_ms_p50"] - ours_p50[base]["ttft_ms_p50"], 2
    )
    result["itl_overhead_ms_p50"] = round(
        theirs_p50[base]["itl_ms_p50"] - ours_p50[base]["itl_ms_p50"], 2
    )
    result["latency"] = rows
    result["setup"] = {
        "model": args.model,
        "dtype": args.dtype,
        "threads": threads,
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "compiled": not args.eager,
        "cores": os.cpu_count(),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()

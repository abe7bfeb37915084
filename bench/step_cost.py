"""What one unified speculative step costs, per batch size and draft depth K, with the bf16
products in each panel layout of ``kernels/cpu/bf16_gemm``: AVX2 FMAs against AVX512-BF16
dot products (where the CPU has them), side by side in one run.

SmolLM2-135M bf16 with the committed EAGLE-3 draft, decode steps compiled, greedy rows at a
context of ``--context`` tokens on scratch blocks. K=0 is a plain decode step (the drafter
deferred, as adaptive speculation runs it); K>0 verifies K drafts and proposes K more. The
engines of both layouts live in one process and their steps alternate, so a slow spell of
a shared machine hits both. Each cell is the median of ``--repeats`` steps. The last line
is one JSON object: {layout: {batch: {K: ms}}}.

    python bench/step_cost.py                          # batch 1, 8, 32; K = 0, 1, 3, 5
    python bench/step_cost.py --batches 1 --repeats 50
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm import tqdm

from engine.llm import LLM
from engine.model_store import prepare
from engine.sampling_params import SamplingParams
from engine.spec.config import SpeculativeConfig
from kernels.cpu import bf16_gemm

DRAFT = Path(__file__).resolve().parents[1] / "drafts" / "smollm2" / "eagle3"


def stepper(llm: LLM, batch: int, context: int, max_k: int) -> Callable[[int], float]:
    """Times one unified step of ``batch`` greedy rows at ``context`` verifying k drafts
    (k = 0: a plain step, the drafter deferred as adaptive speculation runs it)."""
    spec = llm.engine.spec
    assert spec is not None
    per_row = -(-(context + 2 * max_k + 4) // spec.runner.block_size)
    tables = torch.arange(batch * per_row, dtype=torch.int64).view(batch, per_row)
    params = SamplingParams(max_tokens=1, temperature=0.0)
    return lambda k: spec.time_scratch_step(tables, k, context, params, defer_drafter=k == 0)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32], help="rows per step")
    parser.add_argument(
        "--ks", type=int, nargs="+", default=[0, 1, 3, 5], help="draft depths (0: plain step)"
    )
    parser.add_argument("--context", type=int, default=256, help="KV length of every row")
    parser.add_argument("--repeats", type=int, default=15, help="steps per cell (median)")
    args = parser.parse_args()
    layouts = ["avx2", "bf16-dot"] if bf16_gemm.dot_supported() else ["avx2"]
    model_dir = prepare("smollm2")
    max_k = max(args.ks)
    results: dict[str, dict[int, dict[int, float]]] = {name: {} for name in layouts}
    for batch in args.batches:
        steps = {}
        for name in layouts:  # the layout is chosen when the engine packs its weights
            os.environ[bf16_gemm.DOT_ENV] = "1" if name == "bf16-dot" else "0"
            llm = LLM(
                str(model_dir),
                speculative=SpeculativeConfig(str(DRAFT), num_draft_tokens=max_k),
                dtype="bfloat16",
                kv_cache_memory=1 << 30,
                torch_compile=True,
                max_num_seqs=max(batch, 3),
                cpu_gemm="kernel",  # the layouts compared, at every row count
            )
            steps[name] = stepper(llm, batch, args.context, max_k)
        os.environ.pop(bf16_gemm.DOT_ENV)
        for step in steps.values():  # compiles every shape
            for k in args.ks * 2:
                step(k)
        times: dict[tuple[str, int], list[float]] = {(n, k): [] for n in layouts for k in args.ks}
        for _ in tqdm(range(args.repeats), desc=f"batch {batch}"):
            for name, step in steps.items():
                for k in args.ks:
                    times[name, k].append(step(k))
        for name in layouts:
            ms = {k: statistics.median(times[name, k]) * 1e3 for k in args.ks}
            results[name][batch] = ms
            base = ms[args.ks[0]]
            cells = "  ".join(f"K={k} {v:7.2f} ms ({v / base:.2f}x)" for k, v in ms.items())
            print(f"{name:>8} batch {batch:>2}: {cells}", flush=True)
        del steps
    print(json.dumps(results))


if __name__ == "__main__":
    main()

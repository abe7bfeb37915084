"""Decode attention per split of the context (issue 41): ``paged_attention``
(``kernels/triton/attention.py``) at batch 1 to 64, each split count against the default
that ``default_num_splits`` picks, so one GPU run says whether the default is the best.

At batch 1 a decode row has one program per KV head (8 for Llama-3-8B): unsplit, 8 of an
H200's 132 SMs walk the whole context one tile after another, in each of 32 layers of a
step. Split-K spreads the context over more programs, then a second kernel combines them.

Shapes: Llama-3-8B (32 query heads, 8 KV heads, head dim 128) and SmolLM2-135M (9, 3, 64),
bf16, blocks of 16 positions, every row at a KV length of ``--contexts``, with 1 new token
(a plain decode row) and 6 (a verify row at K=5), causal. On CUDA each setting is timed as
a captured graph of ``--calls`` calls, replayed (what the engine's step does: no launch
overhead counted), in microseconds per call. On CPU (``--quick``, the interpreter): a small
shape, timed eagerly, only to show that the script runs.

    PYTHONPATH=. python bench/gpu_attention.py            # on a GPU
    PYTHONPATH=. python bench/gpu_attention.py --quick    # CPU check

Split counts are timed as planned (``plan_splits``: whole tiles a split, so 16 requested
of 528 positions run as 9), the default's among them. The last line is one JSON object
(one follows each setting: a run cut off keeps what it finished): per setting the default
split count, microseconds per planned split count, the best, and how far any split
count's output lies from one split's (the same sums in another order);
``default_over_best_8b_bs1`` (plain rows, the first context) is the default's time over
the best's, 1.0 where the default is the best.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
if not torch.cuda.is_available():  # read when a kernel is defined: before the import
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kernels.triton import attention

BLOCK_SIZE = 16
SHAPES = {"8b": (32, 8, 128), "smollm2": (9, 3, 64)}  # query heads, KV heads, head dim
QUICK_SHAPES = {"tiny": (4, 2, 16)}


def make_case(
    heads: tuple[int, int, int], batch: int, new_tokens: int, context: int, device: torch.device
) -> dict[str, Any]:
    """``batch`` rows of ``new_tokens`` queries ending at position ``context - 1``, over a
    pool with shuffled blocks; the table one block wider than the context (as a step's)."""
    num_heads, num_kv_heads, head_dim = heads
    per_row = -(-context // BLOCK_SIZE) + 1
    num_blocks = batch * per_row
    gen = torch.Generator().manual_seed(0)
    cache = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    t = batch * new_tokens
    positions = torch.arange(context - new_tokens, context).repeat(batch)
    case = {
        "q": torch.randn(t, num_heads, head_dim, generator=gen).to(dtype),
        "k_cache": torch.randn(cache, generator=gen).to(dtype),
        "v_cache": torch.randn(cache, generator=gen).to(dtype),
        "block_tables": torch.randperm(num_blocks, generator=gen).view(batch, per_row),
        "context_lens": torch.full((batch,), context),
        "input_row_offsets": torch.arange(batch + 1) * new_tokens,
        "positions": positions,
    }
    return {name: value.to(device) for name, value in case.items()}


def attend(case: dict[str, Any], new_tokens: int, num_splits: int | None) -> torch.Tensor:
    scale = case["q"].shape[-1] ** -0.5
    return attention.paged_attention(
        **case, scale=scale, is_causal=True, max_query_len=new_tokens, num_splits=num_splits
    )


def time_call(case: dict[str, Any], new_tokens: int, num_splits: int | None, calls: int) -> float:
    """Microseconds per call: on CUDA a captured graph of ``calls`` calls, replayed."""

    def call() -> torch.Tensor:
        return attend(case, new_tokens, num_splits)

    if case["q"].device.type != "cuda":
        call()
        start = time.perf_counter()
        call()
        return (time.perf_counter() - start) * 1e6
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):  # compiles, then warm
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            call()
    graph.replay()
    torch.cuda.synchronize()
    replays = 10
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / (replays * calls)


def default_splits(case: dict[str, Any], heads: tuple[int, int, int], new_tokens: int) -> int:
    """What ``paged_attention`` picks for ``num_splits=None`` (its own planning)."""
    num_heads, num_kv_heads, _ = heads
    num_rows, width = case["block_tables"].shape
    group, max_ctx = num_heads // num_kv_heads, width * BLOCK_SIZE
    device = case["q"].device
    return attention.planned_splits(num_rows, num_kv_heads, new_tokens, group, max_ctx, device)[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="CPU check: a tiny shape")
    parser.add_argument("--batch-sizes", default="1,8,64", help="rows per call")
    parser.add_argument("--contexts", default="512,4096", help="KV length of every row")
    parser.add_argument("--splits", default="1,2,4,8,16", help="split counts to time")
    parser.add_argument("--calls", type=int, default=32, help="calls per captured graph")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not args.quick:
        print("no CUDA device: run with --quick on CPU", file=sys.stderr)
        return 2
    shapes = QUICK_SHAPES if args.quick else SHAPES
    batches = [1] if args.quick else [int(b) for b in args.batch_sizes.split(",")]
    contexts = [192] if args.quick else [int(c) for c in args.contexts.split(",")]
    splits = [1, 2] if args.quick else [int(s) for s in args.splits.split(",")]
    summary: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "results": {},
        "default_over_best_8b_bs1": None,
    }
    for name, heads in shapes.items():
        for context in contexts:
            for batch in batches:
                for new_tokens in (1, 6):
                    case = make_case(heads, batch, new_tokens, context, device)
                    max_ctx = case["block_tables"].shape[1] * BLOCK_SIZE
                    # As planned: whole tiles a split, so some requests run alike.
                    planned = sorted({attention.plan_splits(max_ctx, s)[0] for s in splits})
                    default = default_splits(case, heads, new_tokens)
                    planned = sorted({*planned, default})
                    us = {str(n): time_call(case, new_tokens, n, args.calls) for n in planned}
                    best = min(planned, key=lambda n: us[str(n)])
                    whole = attend(case, new_tokens, 1).float()
                    diff = max(
                        float((attend(case, new_tokens, n).float() - whole).abs().max())
                        for n in planned
                    )
                    key = f"{name}_ctx{context}_bs{batch}_q{new_tokens}"
                    summary["results"][key] = {"default_splits": default, "us": us, "best": best,
                                               "max_abs_diff_from_one_split": diff}  # fmt: skip
                    if summary["default_over_best_8b_bs1"] is None:  # the first: 8B, batch 1
                        ratio = us[str(default)] / us[str(best)]
                        summary["default_over_best_8b_bs1"] = round(ratio, 3)
                    print(f"{key}: default {default} splits {us[str(default)]:.1f} us; "
                          f"best {best} splits {us[str(best)]:.1f} us", flush=True)  # fmt: skip
                    print(json.dumps(summary), flush=True)  # so far: a cut-off run's is kept
    return 0


if __name__ == "__main__":
    sys.exit(main())

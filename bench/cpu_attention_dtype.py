"""Masked SDPA on CPU in bf16 vs fp32, at the shape of a 64-row SmolLM2 decode step.

Context for `engine/attention/torch_backend.py`, which upcasts masked attention to fp32
on CPU. In isolation the two are close (idle machine, 1 thread: bf16 19 ms, upcast 21 ms
including fresh fp32 allocations); inside the engine, where the gathered K/V are fresh
tensors either way, a 64-row decode step ran 1.5x faster upcast. One thread; the last
line is one JSON object of milliseconds per call.

    python bench/cpu_attention_dtype.py
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

ROWS, HEADS, KV_HEADS, CONTEXT, HEAD_DIM = 64, 9, 3, 250, 64


def ms_per_call(fn: Callable[[], torch.Tensor], repeats: int = 20) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1e3


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    torch.set_num_threads(1)
    q = torch.randn(ROWS, HEADS, 1, HEAD_DIM).bfloat16()
    k = torch.randn(ROWS, KV_HEADS, CONTEXT, HEAD_DIM).bfloat16()
    v = torch.randn(ROWS, KV_HEADS, CONTEXT, HEAD_DIM).bfloat16()
    mask = torch.rand(ROWS, 1, 1, CONTEXT) > 0.1
    bf16 = ms_per_call(
        lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    )
    upcast = ms_per_call(
        lambda: F.scaled_dot_product_attention(
            q.float(), k.float(), v.float(), attn_mask=mask, enable_gqa=True
        ).bfloat16()
    )
    print(json.dumps({"bf16_ms": bf16, "fp32_upcast_ms": upcast, "speedup": bf16 / upcast}))


if __name__ == "__main__":
    main()

"""Runs of KV blocks gathered into a staging buffer and scattered back: exact copies."""

from __future__ import annotations

import pytest
import torch

from kernels.reference import blocks as ref
from kernels.triton import blocks as tri

# Runs (first block, length): a run at block 0, one that ends the pool, single blocks.
RUNS = [(3, 2), (10, 3), (0, 1), (19, 1)]


def runs(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int]:
    starts = torch.tensor([s for s, _ in RUNS], device=device)
    offsets = torch.tensor([0, *(n for _, n in RUNS)], device=device).cumsum(0)
    return starts, offsets, sum(n for _, n in RUNS)


def test_run_block_ids_expand_runs_in_staging_order() -> None:
    starts, offsets, n = runs(torch.device("cpu"))
    assert ref.run_block_ids(starts, offsets, n).tolist() == [3, 4, 10, 11, 12, 0, 19]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_gather_then_scatter_copies_exactly_the_runs(dtype, device) -> None:
    """A pool [blocks, block_size, Hkv, D] (a block of 2500 elements: several chunks)."""
    g = torch.Generator().manual_seed(0)
    pool = torch.randn(20, 25, 2, 50, generator=g).to(dtype).to(device)
    starts, offsets, n = runs(device)
    staging = torch.empty((n, 25, 2, 50), dtype=dtype, device=device)
    tri.gather_block_runs(pool, starts, offsets, staging)
    assert torch.equal(staging, ref.gather_block_runs(pool, starts, offsets, staging.clone()))
    assert torch.equal(staging, pool[[3, 4, 10, 11, 12, 0, 19]])

    other = torch.randn(20, 25, 2, 50, generator=g).to(dtype).to(device)
    want = other.clone()
    ref.scatter_block_runs(staging, want, starts, offsets)
    tri.scatter_block_runs(staging, other, starts, offsets)
    assert torch.equal(other, want)
    untouched = [i for i in range(20) if i not in (3, 4, 10, 11, 12, 0, 19)]
    assert torch.equal(other[untouched], want[untouched])
    assert torch.equal(other[[3, 4, 10, 11, 12, 0, 19]], pool[[3, 4, 10, 11, 12, 0, 19]])

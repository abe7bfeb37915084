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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_k_and_v_share_one_staging_buffer_run_by_run(dtype, device) -> None:
    """``stage_starts`` lays K and V of each run side by side (the KV transfer's wire
    order): K of run r from 2 * offsets[r], its V right after."""
    g = torch.Generator().manual_seed(1)
    k, v = (torch.randn(20, 4, 2, 8, generator=g).to(dtype).to(device) for _ in range(2))
    starts, offsets, n = runs(device)
    lengths = offsets[1:] - offsets[:-1]
    stage = {"k": 2 * offsets[:-1], "v": 2 * offsets[:-1] + lengths}
    staging = torch.zeros((2 * n, 4, 2, 8), dtype=dtype, device=device)
    want = staging.clone()
    for pool, name in ((k, "k"), (v, "v")):
        tri.gather_block_runs(pool, starts, offsets, staging, stage[name], n)
        ref.gather_block_runs(pool, starts, offsets, want, stage[name], n)
    assert torch.equal(staging, want)
    expected = [k[[3, 4]], v[[3, 4]], k[[10, 11, 12]], v[[10, 11, 12]], k[[0]], v[[0]]]
    assert torch.equal(staging, torch.cat([*expected, k[[19]], v[[19]]]))

    for pool, name in ((k, "k"), (v, "v")):
        got, back = torch.zeros_like(pool), torch.zeros_like(pool)
        tri.scatter_block_runs(staging, got, starts, offsets, stage[name], n)
        ref.scatter_block_runs(staging, back, starts, offsets, stage[name], n)
        assert torch.equal(got, back)
        ids = [3, 4, 10, 11, 12, 0, 19]
        assert torch.equal(got[ids], pool[ids]) and not got[[1, 2, 5]].any()

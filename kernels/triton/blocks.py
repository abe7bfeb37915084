"""Runs of KV blocks copied between a pool and a contiguous staging buffer (KV transfer:
a sender gathers a layer's runs into one buffer, a receiver scatters them into its pool).

A run is ``(first block id, length)``, as ``kv_transfer.RunPair`` describes it; runs come
as ``run_starts [R]`` and cumulative ``run_offsets [R + 1]``. Run r sits in the staging
buffer from ``stage_starts[r]`` (default: ``run_offsets[r]``, runs back to back), so K and
V of a layer can share one buffer in the wire's order. One program copies one chunk of one
block; it finds its run by counting the offsets at or below its index.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_CHUNK = 1024  # elements per program


@triton.jit
def _copy_runs_kernel(
    pool_ptr,
    staging_ptr,
    run_starts_ptr,
    run_offsets_ptr,
    stage_starts_ptr,
    num_runs,
    block_numel,
    IS_GATHER: tl.constexpr,
    RUNS_POW2: tl.constexpr,
    CHUNK: tl.constexpr,
):
    index = tl.program_id(0).to(tl.int64)  # the index-th block of the runs
    r = tl.arange(0, RUNS_POW2)
    ends = tl.load(run_offsets_ptr + 1 + r, mask=r < num_runs, other=0).to(tl.int64)
    run = tl.sum(((ends <= index) & (r < num_runs)).to(tl.int32), 0)  # runs that end before
    within = index - tl.load(run_offsets_ptr + run).to(tl.int64)
    block = tl.load(run_starts_ptr + run).to(tl.int64) + within
    stage = tl.load(stage_starts_ptr + run).to(tl.int64) + within
    e = tl.program_id(1).to(tl.int64) * CHUNK + tl.arange(0, CHUNK)
    mask = e < block_numel
    if IS_GATHER:
        x = tl.load(pool_ptr + block * block_numel + e, mask=mask)
        tl.store(staging_ptr + stage * block_numel + e, x, mask=mask)
    else:
        x = tl.load(staging_ptr + stage * block_numel + e, mask=mask)
        tl.store(pool_ptr + block * block_numel + e, x, mask=mask)


def _copy(
    pool: torch.Tensor,
    staging: torch.Tensor,
    run_starts: torch.Tensor,
    run_offsets: torch.Tensor,
    stage_starts: torch.Tensor | None,
    num_blocks: int | None,
    is_gather: bool,
) -> None:
    assert pool.is_contiguous() and staging.is_contiguous() and pool.dtype == staging.dtype
    assert pool.shape[1:] == staging.shape[1:]
    if num_blocks is None:
        num_blocks = staging.shape[0]
    block_numel = pool[0].numel() if pool.shape[0] else staging[0].numel()
    if num_blocks == 0 or block_numel == 0:
        return
    num_runs = run_starts.numel()
    grid = (num_blocks, triton.cdiv(block_numel, _CHUNK))
    _copy_runs_kernel[grid](
        pool,
        staging,
        run_starts,
        run_offsets,
        run_offsets if stage_starts is None else stage_starts,
        num_runs,
        block_numel,
        IS_GATHER=is_gather,
        RUNS_POW2=triton.next_power_of_2(max(1, num_runs)),
        CHUNK=_CHUNK,
    )


def gather_block_runs(
    pool: torch.Tensor,  # [num_blocks, *block]: one layer's K or V pool
    run_starts: torch.Tensor,  # [R]
    run_offsets: torch.Tensor,  # [R + 1]
    out: torch.Tensor,  # [S, *block]: the staging buffer
    stage_starts: torch.Tensor | None = None,  # [R]: where each run goes in ``out``
    num_blocks: int | None = None,  # offsets[-1], host-known (default: S)
) -> torch.Tensor:
    """``out[stage_starts[r] + i] = pool[starts[r] + i]`` for every run r: a sender's
    packing."""
    _copy(pool, out, run_starts, run_offsets, stage_starts, num_blocks, is_gather=True)
    return out


def scatter_block_runs(
    src: torch.Tensor,  # [S, *block]: the staging buffer
    pool: torch.Tensor,  # [num_blocks, *block]
    run_starts: torch.Tensor,  # [R]
    run_offsets: torch.Tensor,  # [R + 1]
    stage_starts: torch.Tensor | None = None,  # [R]: where each run is in ``src``
    num_blocks: int | None = None,  # offsets[-1], host-known (default: S)
) -> None:
    """``pool[starts[r] + i] = src[stage_starts[r] + i]``: a receiver's unpacking."""
    _copy(pool, src, run_starts, run_offsets, stage_starts, num_blocks, is_gather=False)

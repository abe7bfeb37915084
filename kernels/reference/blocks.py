"""Runs of KV blocks copied between a pool and a contiguous staging buffer, in plain torch:
the reference of ``kernels.triton.blocks``."""

from __future__ import annotations

import torch


def run_block_ids(
    run_starts: torch.Tensor,  # [R] first block id of each run
    run_offsets: torch.Tensor,  # [R + 1] cumulative run lengths: run r fills offsets[r]:[r+1]
    num_blocks: int,  # host-known total (offsets[-1]), so no synchronisation
) -> torch.Tensor:  # [N] int64: the block id at each staging index
    """The block ids that runs of consecutive ids expand to, in staging order."""
    lengths = run_offsets[1:] - run_offsets[:-1]
    run = torch.repeat_interleave(
        torch.arange(run_starts.numel(), device=run_starts.device), lengths, output_size=num_blocks
    )
    index = torch.arange(num_blocks, device=run_starts.device)
    return run_starts.long()[run] + index - run_offsets.long()[run]


def _ids(
    run_starts: torch.Tensor,
    run_offsets: torch.Tensor,
    stage_starts: torch.Tensor | None,
    num_blocks: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(pool block ids [N], staging indices [N]) of the runs' blocks, in run order."""
    blocks = run_block_ids(run_starts, run_offsets, num_blocks)
    if stage_starts is None:
        return blocks, torch.arange(num_blocks, device=run_starts.device)
    return blocks, run_block_ids(stage_starts, run_offsets, num_blocks)


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
    n = out.shape[0] if num_blocks is None else num_blocks
    blocks, stage = _ids(run_starts, run_offsets, stage_starts, n)
    out.index_copy_(0, stage, pool[blocks])
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
    n = src.shape[0] if num_blocks is None else num_blocks
    blocks, stage = _ids(run_starts, run_offsets, stage_starts, n)
    pool.index_copy_(0, blocks, src[stage])

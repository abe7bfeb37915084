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


def gather_block_runs(
    pool: torch.Tensor,  # [num_blocks, *block]: one layer's K or V pool
    run_starts: torch.Tensor,  # [R]
    run_offsets: torch.Tensor,  # [R + 1]
    out: torch.Tensor,  # [N, *block]: the staging buffer, N = offsets[-1]
) -> torch.Tensor:
    """``out[offsets[r] + i] = pool[starts[r] + i]`` for every run r: a sender's packing."""
    out.copy_(pool[run_block_ids(run_starts, run_offsets, out.shape[0])])
    return out


def scatter_block_runs(
    src: torch.Tensor,  # [N, *block]: the staging buffer
    pool: torch.Tensor,  # [num_blocks, *block]
    run_starts: torch.Tensor,  # [R]
    run_offsets: torch.Tensor,  # [R + 1]
) -> None:
    """``pool[starts[r] + i] = src[offsets[r] + i]``: a receiver's unpacking."""
    pool.index_copy_(0, run_block_ids(run_starts, run_offsets, src.shape[0]), src)

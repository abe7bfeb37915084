"""Copies that checksum the bytes while they are in cache.

A chunk is copied in pieces of ``PIECE_BYTES`` (well inside a core's L2): the sender hashes
each piece right after copying it into the chunk buffer, the receiver right before copying
it out. The running checksum of the pieces, in order, equals the one-shot checksum of the
whole chunk, so the wire value does not change. CPU tensors are copied as memoryviews (a
memmove per piece, no torch dispatch); anything else (GPU pools) with one torch copy.

A layer's blocks travel run by run, K then V of each run (``pack_runs``, ``unpack_runs``).
CUDA pools go through one device buffer in that order, filled by (or emptied with) the
Triton gather (scatter) of ``kernels.triton.blocks``, and one copy to (from) the host.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch

from kv_transfer.checksum import RunningChecksum

PIECE_BYTES = 256 << 10  # measured: 128 KiB to 1 MiB are alike here, 64 KiB is slower


def byte_view(t: torch.Tensor) -> memoryview | None:
    """The bytes of a contiguous CPU tensor as a flat memoryview (no copy), else None."""
    if t.device.type != "cpu" or not t.is_contiguous():
        return None
    flat = t.detach().reshape(-1)
    if flat.dtype != torch.uint8:
        flat = flat.view(torch.uint8)
    mv: memoryview = flat.numpy().data
    return mv


def copy_then_hash(dst: memoryview, src: memoryview, running: RunningChecksum) -> None:
    """``dst[:] = src``, adding each piece to ``running`` just after copying it."""
    if len(dst) != len(src):
        raise ValueError(f"copy: {len(src)} bytes into {len(dst)}")
    for start in range(0, len(src), PIECE_BYTES):
        end = start + PIECE_BYTES
        dst[start:end] = src[start:end]
        running.update(dst[start:end])


def hash_then_copy(dst: memoryview, src: memoryview, running: RunningChecksum) -> None:
    """``dst[:] = src``, adding each piece to ``running`` just before copying it."""
    if len(dst) != len(src):
        raise ValueError(f"copy: {len(src)} bytes into {len(dst)}")
    for start in range(0, len(src), PIECE_BYTES):
        end = start + PIECE_BYTES
        piece = src[start:end]
        running.update(piece)
        dst[start:end] = piece


def pack(dst: memoryview, src: torch.Tensor, running: RunningChecksum) -> None:
    """Copies ``src``'s bytes into ``dst`` (as long), adding them to ``running``."""
    src_bytes = byte_view(src)
    if src_bytes is not None:
        copy_then_hash(dst, src_bytes, running)
        return
    if len(dst):  # a GPU or strided source: one torch copy, then the checksum
        _as_tensor(dst).view(src.dtype).view(src.shape).copy_(src)
    for start in range(0, len(dst), PIECE_BYTES):
        running.update(dst[start : start + PIECE_BYTES])


def unpack(dst: torch.Tensor, src: memoryview, running: RunningChecksum) -> None:
    """Copies ``src`` into ``dst``'s bytes (as long), adding them to ``running``."""
    dst_bytes = byte_view(dst)
    if dst_bytes is not None:
        hash_then_copy(dst_bytes, src, running)
        return
    for start in range(0, len(src), PIECE_BYTES):  # GPU or strided: checksum, then copy
        running.update(src[start : start + PIECE_BYTES])
    if len(src):
        dst.copy_(_as_tensor(src).view(dst.dtype).view(dst.shape))


def pack_runs(
    dst: memoryview,
    kv: Sequence[torch.Tensor],  # one layer's pools: K and V, or MLA's one
    runs: Sequence[tuple[int, int]],  # (first block, number of blocks)
    running: RunningChecksum,
    *,
    use_triton: bool | None = None,  # the Triton gather; None: where pools are on CUDA
) -> int:
    """Copies each run's blocks, K then V, into ``dst`` back to back, adding them to
    ``running``; returns the bytes written."""
    block_bytes = kv[0][0].numel() * kv[0].element_size()  # K (or V) of one block
    total = sum(n for _, n in runs) * block_bytes * len(kv)
    if kv[0].is_cuda if use_triton is None else use_triton:
        from kernels.triton.blocks import gather_block_runs  # imports triton: only here

        staging, starts, offsets, stage_starts = _staging(kv, runs)
        for pool, stage in zip(kv, stage_starts, strict=True):
            gather_block_runs(pool, starts, offsets, staging, stage, len(staging) // len(kv))
        pack(dst[:total], staging, running)
        return total
    offset = 0
    pool_bytes = [byte_view(t) for t in kv]  # whole pools: no view per run
    for first, num_blocks in runs:
        num_bytes, start = num_blocks * block_bytes, first * block_bytes
        for pool_tensor, src in zip(kv, pool_bytes, strict=True):
            piece = dst[offset : offset + num_bytes]
            if src is not None:
                copy_then_hash(piece, src[start : start + num_bytes], running)
            else:
                pack(piece, pool_tensor[first : first + num_blocks], running)
            offset += num_bytes
    return total


def unpack_runs(
    kv: Sequence[torch.Tensor],  # one layer's pools: K and V, or MLA's one
    runs: Sequence[tuple[int, int]],  # (first block, number of blocks)
    src: memoryview,  # from the layer's first byte on
    running: RunningChecksum,
    *,
    use_triton: bool | None = None,  # the Triton scatter; None: where pools are on CUDA
) -> int:
    """Copies ``src`` into each run's blocks, K then V (as ``pack_runs`` lays them out),
    adding the bytes to ``running``; returns the bytes read."""
    block_bytes = kv[0][0].numel() * kv[0].element_size()
    total = sum(n for _, n in runs) * block_bytes * len(kv)
    if kv[0].is_cuda if use_triton is None else use_triton:
        from kernels.triton.blocks import scatter_block_runs  # imports triton: only here

        staging, starts, offsets, stage_starts = _staging(kv, runs)
        unpack(staging, src[:total], running)
        for pool, stage in zip(kv, stage_starts, strict=True):
            scatter_block_runs(staging, pool, starts, offsets, stage, len(staging) // len(kv))
        return total
    offset = 0
    pool_bytes = [byte_view(t) for t in kv]
    for first, num_blocks in runs:
        num_bytes, start = num_blocks * block_bytes, first * block_bytes
        for pool_tensor, dst in zip(kv, pool_bytes, strict=True):
            piece = src[offset : offset + num_bytes]
            if dst is not None:
                hash_then_copy(dst[start : start + num_bytes], piece, running)
            else:
                unpack(pool_tensor[first : first + num_blocks], piece, running)
            offset += num_bytes
    return total


def _staging(
    kv: Sequence[torch.Tensor], runs: Sequence[tuple[int, int]]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """A device buffer for the runs' blocks of every pool tensor in the wire's order, and
    the block kernels' arguments on that device: run starts [R], cumulative offsets
    [R + 1], and for each pool tensor where its runs begin in the buffer [R]."""
    device, num_tensors = kv[0].device, len(kv)
    offsets = [0]
    for _, n in runs:
        offsets.append(offsets[-1] + n)
    stage_starts = [
        [num_tensors * offsets[r] + t * n for r, (_, n) in enumerate(runs)]
        for t in range(num_tensors)
    ]
    shape = (num_tensors * offsets[-1], *kv[0].shape[1:])
    return (
        torch.empty(shape, dtype=kv[0].dtype, device=device),
        torch.tensor([first for first, _ in runs], device=device),
        torch.tensor(offsets, device=device),
        [torch.tensor(s, device=device) for s in stage_starts],
    )


def _as_tensor(data: memoryview) -> torch.Tensor:
    with warnings.catch_warnings():  # read-only bytes: such a view is only read from
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(data, dtype=torch.uint8)

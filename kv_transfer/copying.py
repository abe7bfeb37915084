"""Copies that checksum the bytes while they are in cache.

A chunk is copied in pieces of ``PIECE_BYTES`` (well inside a core's L2): the sender hashes
each piece right after copying it into the chunk buffer, the receiver right before copying
it out. The running checksum of the pieces, in order, equals the one-shot checksum of the
whole chunk, so the wire value does not change. CPU tensors are copied as memoryviews (a
memmove per piece, no torch dispatch); anything else (GPU pools) with one torch copy.
"""

from __future__ import annotations

import warnings

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


def _as_tensor(data: memoryview) -> torch.Tensor:
    with warnings.catch_warnings():  # read-only bytes: such a view is only read from
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(data, dtype=torch.uint8)

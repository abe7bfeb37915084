"""Attention backends over the paged KV cache.

A backend turns a batch description into its own metadata once per step
(``build_metadata``) and then runs attention for every layer with it
(``forward``). ``torch`` works everywhere (on CPU with the C++ kernels of
``kernels/cpu``); ``triton`` and ``flash_attn`` are for CUDA; ``auto`` picks
(``select_backend``).
"""

from __future__ import annotations

import torch

from engine.attention import flash_attn_backend
from engine.attention.base import AttentionBackend, BatchLayout
from engine.attention.torch_backend import TorchAttentionBackend

__all__ = [
    "BACKENDS",
    "AttentionBackend",
    "BatchLayout",
    "TorchAttentionBackend",
    "get_backend",
    "select_backend",
]

BACKENDS = ("auto", "torch", "triton", "flash_attn")


def select_backend(device: torch.device | str, block_size: int) -> str:
    """What ``auto`` means: on CUDA flash-attn where it is importable and takes the block
    size, else the Triton kernels; anywhere else the torch backend (the CPU kernels)."""
    if torch.device(device).type != "cuda":
        return "torch"
    if flash_attn_backend.is_importable() and flash_attn_backend.supports(block_size):
        return "flash_attn"
    return "triton"


def get_backend(
    name: str = "torch", *, device: torch.device | str = "cpu", block_size: int = 16
) -> AttentionBackend:
    """The backend called ``name`` (``device`` and ``block_size`` decide what ``auto`` is)."""
    if name == "auto":
        name = select_backend(device, block_size)
    if name == "torch":
        return TorchAttentionBackend()
    if name == "triton":
        from engine.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    if name == "flash_attn":
        return flash_attn_backend.FlashAttnBackend(block_size)
    raise ValueError(f"attention backend: {name!r} is not available; allowed: {list(BACKENDS)}")

"""Token bitmasks: int32 words, bit ``v % 32`` of word ``v // 32`` set = token v allowed."""

from __future__ import annotations

import torch


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Disallowed tokens get -inf: bit (v % 32) of word (v // 32) clear. [B, S, V]"""
    v = logits.shape[-1]
    ids = torch.arange(v, device=logits.device)
    bits = (bitmask[..., ids // 32] >> (ids % 32)) & 1  # [B, S, V]
    return logits.masked_fill(bits == 0, float("-inf"))

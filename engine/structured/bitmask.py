"""Token bitmasks: int32 words, bit ``v % 32`` of word ``v // 32`` set = token v allowed."""

from __future__ import annotations

import torch


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Disallowed tokens get -inf: bit (v % 32) of word (v // 32) clear. [B, S, V]"""
    v = logits.shape[-1]
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    bits = (bitmask[..., None] >> shifts) & 1  # [B, S, W, 32]: a broadcast, not a gather
    return logits.masked_fill(bits.flatten(-2)[..., :v] == 0, float("-inf"))

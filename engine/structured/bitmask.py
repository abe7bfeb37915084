"""Token bitmasks: int32 words, bit ``v % 32`` of word ``v // 32`` set = token v allowed."""

from __future__ import annotations

import torch


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Disallowed tokens get -inf: bit (v % 32) of word (v // 32) clear. [B, S, V]"""
    v = logits.shape[-1]
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    bits = (bitmask[..., None] >> shifts) & 1  # [B, S, W, 32]: a broadcast, not a gather
    return logits.masked_fill(bits.flatten(-2)[..., :v] == 0, float("-inf"))


def apply_bitmask_rows(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """In place: only ``rows`` of ``logits`` [N, V] get their ``bitmask`` [N, W] row's -inf;
    other rows are neither read nor written (a batch with no masked row costs nothing).
    xgrammar's kernel (CPU or CUDA) where it is installed, else ``apply_bitmask``."""
    if not rows:
        return
    try:
        import xgrammar as xgr
    except ImportError:
        index = torch.tensor(rows, device=logits.device)
        logits[index] = apply_bitmask(logits[index][:, None], bitmask[index][:, None])[:, 0]
        return
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[-1], indices=rows)

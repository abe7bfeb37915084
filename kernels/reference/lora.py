"""LoRA's segmented products in plain torch: the reference of ``kernels.triton.lora`` (the
same names and signatures; fp32 sums in another order).

A step's tokens come in groups, each under one adapter (``lora_grouped_offsets`` [G + 1],
``lora_ids`` [G], -1: none, the seed's names). ``sgmv_shrink`` takes each group's tokens
to its adapter's rank, ``sgmv_expand`` back to the projection's width: SGMV (Punica's
segmented gather matrix-vector products). The adapters' weights are stacked, each padded
with zeros to the largest rank ``R``: ``a`` [S, R, in] (``A``) and ``b`` [S, R, out]
(``B`` transposed, its scaling in it). A slot past the ``S`` stacked is none (a projection
no adapter in a later slot targets).
"""

from __future__ import annotations

import torch


def sgmv_shrink(
    x: torch.Tensor,  # [T, in]
    a: torch.Tensor,  # [S, R, in]
    lora_grouped_offsets: torch.Tensor,  # [G + 1] int
    lora_ids: torch.Tensor,  # [G] int, -1: none
    max_group_len: int,  # the longest group's tokens (the kernel's grid)
) -> torch.Tensor:
    """[T, R] float32: each token times its group's adapter's ``A``; zeros without one."""
    y = torch.zeros(x.shape[0], a.shape[1], dtype=torch.float32, device=x.device)
    offsets, ids = lora_grouped_offsets.tolist(), lora_ids.tolist()
    for g, slot in enumerate(ids):
        start, end = offsets[g], offsets[g + 1]
        if 0 <= slot < a.shape[0] and end > start:
            y[start:end] = x[start:end].float() @ a[slot].float().T
    return y


def sgmv_expand(
    y: torch.Tensor,  # [T, R] float32, sgmv_shrink's
    b: torch.Tensor,  # [S, R, out]
    lora_grouped_offsets: torch.Tensor,
    lora_ids: torch.Tensor,
    max_group_len: int,
) -> torch.Tensor:
    """[T, out] float32: each token's shrunk row times its group's adapter's scaled
    ``B``; zeros without one."""
    out = torch.zeros(y.shape[0], b.shape[2], dtype=torch.float32, device=y.device)
    offsets, ids = lora_grouped_offsets.tolist(), lora_ids.tolist()
    for g, slot in enumerate(ids):
        start, end = offsets[g], offsets[g + 1]
        if 0 <= slot < b.shape[0] and end > start:
            out[start:end] = y[start:end] @ b[slot].float()
    return out

"""LoRA deltas over a batch whose rows each use one adapter or none, grouped by adapter:
segmented products (SGMV's shrink, then expand), in torch.

Rows come grouped: ``lora_grouped_offsets`` (the seed's name) are the token offsets where
each adapter's group starts and ends, and ``lora_ids`` say which adapter each group uses
(``-1``: none, no delta). Each group's tokens are shrunk to its rank by ``A`` and expanded
by ``B``, times its scaling.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.lora.adapter import LoraWeights


def lora_delta(
    x: torch.Tensor,  # [T, in]
    lora_grouped_offsets: Sequence[int],  # [G + 1]: group g is tokens [o[g], o[g+1])
    lora_ids: Sequence[int],  # [G]: each group's adapter, -1 for none
    weights: Sequence[LoraWeights | None],  # by adapter id: this module's, or None
    out_features: int,
) -> torch.Tensor:
    """[T, out]: each group's ``(x @ A.T) @ B.T * scaling``, zeros where it has none."""
    out = x.new_zeros(x.shape[0], out_features)
    for g, adapter in enumerate(lora_ids):
        start, end = lora_grouped_offsets[g], lora_grouped_offsets[g + 1]
        w = weights[adapter] if 0 <= adapter < len(weights) else None
        if w is None or start == end:
            continue
        shrunk = x[start:end].float() @ w.a.T  # [n, r]
        out[start:end] = (shrunk @ w.b.T * w.scaling).to(out.dtype)
    return out

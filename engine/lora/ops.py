"""LoRA deltas over a batch whose rows each use one adapter or none, grouped by adapter,
in torch, two ways:

- ``lora_delta``: segmented products (SGMV's shrink, then expand), one pair per group:
  for groups of many tokens (prefill chunks).
- ``DenseLora``: every loaded adapter's ``A`` stacked into one matrix and its ``B`` (times
  its scaling) into another, one shrink of every token by every adapter, each token's
  other adapters' columns masked to zero, then one expand: two products per projection
  whatever the groups, for steps of few tokens (decode rows, where a batch of eight rows
  under eight adapters made 1680 small product pairs a step; bench/lora.py).

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


DENSE_MAX_TOKENS = 64  # steps of more tokens take lora_delta's per-group products


def token_mask(
    lora_grouped_offsets: Sequence[int],
    lora_ids: Sequence[int],
    num_slots: int,
    device: torch.device,
) -> torch.Tensor:
    """[T, num_slots] float32: 1 where token t runs under adapter id s (ids from 0 below
    ``num_slots``), else 0 (no adapter, or an id past the slots)."""
    num_tokens = lora_grouped_offsets[-1]
    mask = torch.zeros(num_tokens, num_slots, dtype=torch.float32)
    for g, adapter in enumerate(lora_ids):
        if 0 <= adapter < num_slots:
            mask[lora_grouped_offsets[g] : lora_grouped_offsets[g + 1], adapter] = 1.0
    return mask.to(device)


class DenseLora:
    """One projection's adapters stacked (see the module's docstring): its parts'
    ``weights[p][id]`` (None: none), zero-padded to each part's largest rank."""

    def __init__(
        self,
        weights: Sequence[Sequence[LoraWeights | None]],
        in_features: int,
        out_features: Sequence[int],
        device: torch.device,
    ) -> None:
        self.num_slots = max(len(by_id) for by_id in weights)
        self.ranks = [max((w.rank for w in by_id if w is not None), default=0) for by_id in weights]
        a_parts, self.b = [], []
        for by_id, out, r in zip(weights, out_features, self.ranks, strict=True):
            a = torch.zeros(self.num_slots, r, in_features, device=device)
            b = torch.zeros(self.num_slots, r, out, device=device)
            for slot, w in enumerate(by_id):
                if w is not None:
                    a[slot, : w.rank] = w.a
                    b[slot, : w.rank] = w.b.T * w.scaling
            a_parts.append(a.reshape(-1, in_features))
            self.b.append(b.reshape(-1, out))
        self.a = torch.cat(a_parts)  # [sum of slots x rank, in]: one shrink for every part
        self.out_features = list(out_features)

    def deltas(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """[T, sum(out)]: each token's delta under its adapter (``token_mask``'s rows)."""
        shrunk = x.float() @ self.a.T  # [T, sum(S * r)]
        out, start = [], 0
        for r, b, width in zip(self.ranks, self.b, self.out_features, strict=True):
            if r == 0:
                out.append(x.new_zeros(x.shape[0], width, dtype=torch.float32))
                continue
            part = shrunk[:, start : start + self.num_slots * r].view(-1, self.num_slots, r)
            start += self.num_slots * r
            out.append((part * mask[:, :, None]).reshape(x.shape[0], -1) @ b)
        return torch.cat(out, dim=-1)

"""LoRA deltas over a batch whose rows each use one adapter or none, grouped by adapter,
in torch, two ways:

- ``lora_delta``: segmented products (SGMV's shrink, then expand), one pair per group:
  for groups of many tokens (prefill chunks).
- ``DenseLora``: the adapters in memory, ``A`` stacked into one matrix and ``B`` (times
  its scaling) into another per part, one shrink of every token by every adapter, each
  token's other adapters' columns masked to zero, then one expand per part: a step's
  products do not grow with its groups, for steps of few tokens (decode rows; per-group
  products cost more there, bench/RESULTS.md).

Rows come grouped: ``lora_grouped_offsets`` (the seed's name) are the token offsets where
each adapter's group starts and ends, and ``lora_ids`` say which adapter slot each group
uses (``-1``: none, no delta; engine.lora.registry gives adapters their slots). Each
group's tokens are shrunk to its rank by ``A`` and expanded by ``B``, times its scaling.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from engine.lora.adapter import LoraWeights
from kernels.cpu import bf16_gemm


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
    ``weights[p][id]`` (None: none), zero-padded to each part's largest rank, in fp32
    (aten's fp32 products of these few rows beat bf16's here: bench/RESULTS.md)."""

    def __init__(
        self,
        weights: Sequence[Sequence[LoraWeights | None]],
        in_features: int,
        out_features: Sequence[int],
        device: torch.device,
        packed: bool = False,
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
        # Each part's as SGMV takes them (kernels.reference.lora): [S, r, in], [S, r, out]
        starts = [0]
        for r in self.ranks:
            starts.append(starts[-1] + self.num_slots * r)
        # For a bf16 model on CPU: bf16 copies in the CPU kernel's panels
        # (kernels.cpu.bf16_gemm), half the bytes a step reads
        self.panels: tuple[torch.Tensor, list[torch.Tensor]] | None = None
        if packed:
            self.panels = (
                bf16_gemm.pack(self.a.to(torch.bfloat16)),
                [bf16_gemm.pack(b.T.contiguous().to(torch.bfloat16)) if r else torch.empty(0)
                 for b, r in zip(self.b, self.ranks, strict=True)],
            )  # fmt: skip
        self.sgmv_weights = [
            (self.a[s:e].view(self.num_slots, r, in_features), b.view(self.num_slots, r, out))
            for s, e, r, b, out in zip(
                starts, starts[1:], self.ranks, self.b, out_features, strict=False
            )
        ]

    def column_mask(self, mask: torch.Tensor) -> torch.Tensor:
        """``token_mask``'s [T, S] widened to the shrink's columns, [T, sum(S * r)]: each
        slot's 1 or 0 on each of its rank's columns, part after part."""
        return torch.cat([mask.repeat_interleave(r, dim=1) for r in self.ranks], dim=1)

    def add_deltas(self, y: torch.Tensor, x: torch.Tensor, column_mask: torch.Tensor) -> None:
        """Adds each token's delta under its adapter into ``y`` [T, sum(out)] (the base
        product's output, any float dtype; summed in fp32): one shrink, one mask, one
        expand per part, in place: few ops, since a step runs this in every adapted
        projection (bench/lora.py). With ``panels``, the products are the bf16 kernel's,
        in bf16."""
        if self.panels is None:
            masked = (x.float() @ self.a.T).mul_(column_mask)  # [T, sum(S * r)]
        else:
            shrunk = bf16_gemm.linear(x.to(torch.bfloat16), self.panels[0], None, len(self.a))
            masked = shrunk.mul_(column_mask)
        start = column = 0
        for i, (r, width) in enumerate(zip(self.ranks, self.out_features, strict=True)):
            if r:
                part = masked[:, start : start + self.num_slots * r]
                if self.panels is None:
                    expanded = part @ self.b[i]
                else:
                    expanded = bf16_gemm.linear(part.contiguous(), self.panels[1][i], None, width)
                if width == y.shape[1]:
                    y += expanded
                else:
                    y[:, column : column + width] += expanded
            start += self.num_slots * r
            column += width

    def deltas(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """[T, sum(out)] float32: each token's delta under its adapter (``token_mask``'s
        rows); ``add_deltas`` into zeros."""
        y = torch.zeros(x.shape[0], sum(self.out_features), device=x.device)
        self.add_deltas(y, x, self.column_mask(mask))
        return y

    def segmented(
        self,
        x: torch.Tensor,
        groups: tuple[torch.Tensor, torch.Tensor, int],  # LoraStep.device_groups'
        sgmv: Any,  # kernels.triton.lora on the GPU (kernels.reference.lora: the same)
    ) -> torch.Tensor:
        """``deltas`` by SGMV's segmented products: each group's tokens times its own
        adapter only (the GPU path, any number of tokens)."""
        out = []
        for (a, b), width in zip(self.sgmv_weights, self.out_features, strict=True):
            if a.shape[1] == 0:
                out.append(x.new_zeros(x.shape[0], width, dtype=torch.float32))
                continue
            out.append(sgmv.sgmv_expand(sgmv.sgmv_shrink(x, a, *groups), b, *groups))
        return torch.cat(out, dim=-1)

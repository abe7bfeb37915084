"""LoRA deltas over a batch whose rows each use one adapter or none, grouped by adapter,
three ways:

- ``CpuSgmv``: on a CPU with Tandem's kernels built, one call per projection
  (``kernels/cpu/lora_sgmv.cpp``): each group's tokens shrunk by its adapter's ``A`` and
  expanded by its ``B``, added into the base product in place, each used adapter's
  weights read once per chunk of up to 16 of its tokens, for any number of tokens.
- ``lora_delta``: segmented products in torch (SGMV's shrink, then expand), one pair per
  group: where the kernels are not built, for groups of many tokens (prefill chunks).
- ``DenseLora``: the adapters in memory, ``A`` stacked into one matrix and ``B`` (times
  its scaling) into another per part, one shrink of every token by every adapter, each
  token's other adapters' columns masked to zero, then one expand per part: a step's
  products do not grow with its groups, for steps of few tokens where the kernels are not
  built; on CUDA, its stacks are what the Triton SGMV kernels take (``segmented``).

Rows come grouped: ``lora_grouped_offsets`` (the seed's name) are the token offsets where
each adapter's group starts and ends, and ``lora_ids`` say which adapter slot each group
uses (``-1``: none, no delta; engine.lora.registry gives adapters their slots). Each
group's tokens are shrunk to its rank by ``A`` and expanded by ``B``, times its scaling.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import torch

from engine.lora.adapter import LoraWeights
from kernels.cpu import extension


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


DENSE_MAX_TOKENS = 64  # without the kernels, more tokens take lora_delta's per-group products
PANEL = 16  # rank columns per panel of CpuSgmv's A, as in lora_sgmv.cpp
BLOCK = 64  # output columns per block of CpuSgmv's B, as in lora_sgmv.cpp


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


def stack_parts(
    weights: Sequence[Sequence[LoraWeights | None]],
    in_features: int,
    out_features: Sequence[int],
    device: torch.device,
) -> tuple[list[int], list[torch.Tensor], list[torch.Tensor]]:
    """One projection's adapters stacked per part in fp32, each zero-padded to the part's
    largest rank: the parts' ranks, ``A`` [S, r, in] and ``B`` transposed times its scaling
    [S, r, out] (``weights[p][slot]``, None: none; S the most slots any part has)."""
    num_slots = max(len(by_id) for by_id in weights)
    ranks = [max((w.rank for w in by_id if w is not None), default=0) for by_id in weights]
    a_parts, b_parts = [], []
    for by_id, out, r in zip(weights, out_features, ranks, strict=True):
        a = torch.zeros(num_slots, r, in_features, device=device)
        b = torch.zeros(num_slots, r, out, device=device)
        for slot, w in enumerate(by_id):
            if w is not None:
                a[slot, : w.rank] = w.a
                b[slot, : w.rank] = w.b.T * w.scaling
        a_parts.append(a)
        b_parts.append(b)
    return ranks, a_parts, b_parts


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
    ) -> None:
        self.num_slots = max(len(by_id) for by_id in weights)
        self.ranks, a_parts, b_parts = stack_parts(weights, in_features, out_features, device)
        # [sum of slots x rank, in]: one shrink for every part
        self.a = torch.cat([a.reshape(-1, in_features) for a in a_parts])
        self.b = [b.reshape(-1, b.shape[-1]) for b in b_parts]
        self.out_features = list(out_features)
        # Each part's as SGMV takes them (kernels.reference.lora): [S, r, in], [S, r, out]
        self.sgmv_weights = list(zip(a_parts, b_parts, strict=True))

    def column_mask(self, mask: torch.Tensor) -> torch.Tensor:
        """``token_mask``'s [T, S] widened to the shrink's columns, [T, sum(S * r)]: each
        slot's 1 or 0 on each of its rank's columns, part after part."""
        return torch.cat([mask.repeat_interleave(r, dim=1) for r in self.ranks], dim=1)

    def add_deltas(self, y: torch.Tensor, x: torch.Tensor, column_mask: torch.Tensor) -> None:
        """Adds each token's delta under its adapter into ``y`` [T, sum(out)] (the base
        product's output, any float dtype; summed in fp32): one shrink, one mask, one
        expand per part, in place: few ops, since a step runs this in every adapted
        projection."""
        masked = (x.float() @ self.a.T).mul_(column_mask)  # [T, sum(S * r)]
        start = column = 0
        for i, (r, width) in enumerate(zip(self.ranks, self.out_features, strict=True)):
            if r:
                expanded = masked[:, start : start + self.num_slots * r] @ self.b[i]
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


class CpuSgmv:
    """One projection's adapters in the layout of the CPU SGMV kernel
    (``kernels/cpu/lora_sgmv.cpp``), in the model's dtype (bf16 or fp32): every slot's
    ``A`` of all parts in one stack, the parts' ranks one after another, in panels of 16
    rank columns, [S, R/16, in, 16]; each part's ``B`` transposed with its scaling in it,
    in blocks of 64 output columns, [S, out/64, r, 64]. ``weights[p][slot]`` as
    ``DenseLora`` takes them."""

    def __init__(
        self,
        weights: Sequence[Sequence[LoraWeights | None]],
        in_features: int,
        out_features: Sequence[int],
        dtype: torch.dtype,
    ) -> None:
        num_slots = max(len(by_id) for by_id in weights)
        cpu = torch.device("cpu")
        ranks, a_parts, b_parts = stack_parts(weights, in_features, out_features, cpu)
        self.rank_offsets = list(itertools.accumulate(ranks, initial=0))
        columns = -(-self.rank_offsets[-1] // PANEL) * PANEL
        a = torch.nn.functional.pad(torch.cat(a_parts, dim=1), (0, 0, 0, columns - sum(ranks)))
        self.a = a.view(num_slots, columns // PANEL, PANEL, in_features).transpose(2, 3)
        self.a = self.a.contiguous().to(dtype)
        # A slot none of whose parts holds weights (unloaded, or targeting none of them)
        # runs as no adapter
        self.slots_without = {
            slot
            for slot in range(num_slots)
            if all(slot >= len(by_id) or by_id[slot] is None for by_id in weights)
        }
        self.dtype = dtype
        # B in blocks of BLOCK output columns, zero-padded: [S, out/BLOCK, r, BLOCK]
        self.b = [
            torch.nn.functional.pad(b, (0, -out % BLOCK))
            .view(num_slots, b.shape[1], -(-out // BLOCK), BLOCK)
            .transpose(1, 2)
            .contiguous()
            .to(dtype)
            for b, out in zip(b_parts, out_features, strict=True)
        ]
        self.column_offsets = list(itertools.accumulate(out_features, initial=0))

    def add_deltas(
        self, y: torch.Tensor, x: torch.Tensor, lora_grouped_offsets: list[int], lora_ids: list[int]
    ) -> None:
        """Adds each token's delta under its group's adapter into ``y`` [T, sum(out)] (the
        base product's output, in ``x``'s dtype), in place, rounded once."""
        torch.ops.tandem_cpu.sgmv_add(
            y, x.contiguous(), self.a, self.b, self.rank_offsets, self.column_offsets,
            lora_grouped_offsets, self.slot_ids(lora_ids),
        )  # fmt: skip

    def slot_ids(self, lora_ids: list[int]) -> list[int]:
        """``lora_ids`` as the kernel takes them: a slot without weights here runs as none
        (its weights are zeros, not worth reading)."""
        if not self.slots_without:
            return lora_ids
        return [-1 if i in self.slots_without else i for i in lora_ids]

    @staticmethod
    def applies(x: torch.Tensor) -> bool:
        """Whether the kernel runs ``x``'s products: a CPU tensor of bf16 or fp32, where
        Tandem's CPU kernels are built."""
        return (
            x.device.type == "cpu"
            and x.dtype in (torch.bfloat16, torch.float32)
            and extension.available()
        )

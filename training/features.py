"""The frozen target over training sequences: what a drafter conditions on, per token.

One ragged forward per batch, one row per sequence from position 0, through the serving
model, paged KV cache and torch backend; features come from the drafter's own
``features`` so that training and serving read the same hidden states. With ``top_k``,
the same forward also gives each position's next-token distribution, cut to its ``top_k``
most likely tokens: the soft labels a draft can be distilled on (``SoftLabels``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.attention.base import BatchLayout
from engine.attention.torch_backend import TorchAttentionBackend
from engine.kv_cache import KVCacheParams, PagedKVCache
from engine.models.llama3 import Llama3Model
from engine.spec.drafters.base import Drafter

BLOCK_SIZE = 16


def prefill_layout(
    lengths: Sequence[int], device: torch.device, capacities: Sequence[int] | None = None
) -> BatchLayout:
    """Rows of ``lengths`` tokens from position 0; row b owns consecutive blocks, enough for
    ``capacities[b]`` positions (default: its length)."""
    offsets, positions, slots = [0], [], []  # type: list[int], list[int], list[int]
    tables: list[list[int]] = []
    first_block = 0
    num_blocks = [-(-n // BLOCK_SIZE) for n in (capacities or lengths)]
    for n, nb in zip(lengths, num_blocks, strict=True):
        offsets.append(offsets[-1] + n)
        positions += range(n)
        slots += range(first_block * BLOCK_SIZE, first_block * BLOCK_SIZE + n)
        tables.append(list(range(first_block, first_block + nb)) + [0] * (max(num_blocks) - nb))
        first_block += nb

    def t(values: list[int] | list[list[int]]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    return BatchLayout(
        input_row_offsets=t(offsets),
        positions=t(positions),
        slot_mapping=t(slots),
        context_lens=t(list(lengths)),
        block_tables=t(tables),
        block_size=BLOCK_SIZE,
        max_query_len=max(lengths),
        max_context_len=max(lengths),
        is_causal_prefill=True,
    )


@dataclass
class SoftLabels:
    """The target's next-token distribution at each position of a batch, cut to its top k:
    position i's entries score token i + 1. Zero probabilities past each row's end."""

    probs: torch.Tensor  # [B, L, k] fp32, the target's softmax (not renormalised)
    token_ids: torch.Tensor  # [B, L, k] int64 target ids, most likely first

    def at(self, rows: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(probs, token_ids) at [rows, positions] (broadcast together)."""
        return self.probs[rows, positions], self.token_ids[rows, positions]


@dataclass
class TargetRows:
    """Per sequence: the drafter's features [len_i, F] fp32 and, with ``top_k``, the
    target's top-k probabilities [len_i, k] fp32 and token ids [len_i, k] int64."""

    features: list[torch.Tensor]
    top_probs: list[torch.Tensor] | None = None
    top_ids: list[torch.Tensor] | None = None


class TargetFeatures:
    """Runs ``target`` (no grad) and returns ``drafter.features`` in fp32; with ``top_k``
    > 0, also the target's ``top_k`` most likely next tokens at every position."""

    def __init__(
        self, target: Llama3Model, drafter: Drafter, device: torch.device, top_k: int = 0
    ) -> None:
        self.target, self.drafter, self.device, self.top_k = target, drafter, device, top_k
        self.backend = TorchAttentionBackend()
        self._kv: PagedKVCache | None = None

    def _cache(self, num_blocks: int) -> PagedKVCache:
        if self._kv is None or self._kv.num_blocks < num_blocks:
            params = KVCacheParams.from_config(self.target.config, BLOCK_SIZE)
            self._kv = None  # free the old pools first
            self._kv = PagedKVCache(params, num_blocks, self.device)
        return self._kv

    def ragged(self, sequences: Sequence[list[int]]) -> list[torch.Tensor]:
        """Per sequence: [len_i, F] fp32."""
        return self.rows(sequences).features

    @torch.no_grad()
    def rows(self, sequences: Sequence[list[int]]) -> TargetRows:
        """Features, and with ``top_k`` the target's top-k next tokens, per sequence."""
        lengths = [len(s) for s in sequences]
        layout = prefill_layout(lengths, self.device)
        kv = self._cache(sum(-(-n // BLOCK_SIZE) for n in lengths))
        tokens = torch.tensor([t for s in sequences for t in s], device=self.device)
        out = self.target(
            tokens,
            layout.positions,
            kv.layers,
            self.backend,
            self.backend.build_metadata(layout),
            # Every position's logits for soft labels, else one row (unused).
            layout.positions.new_tensor(range(len(tokens)))
            if self.top_k
            else layout.input_row_offsets[1:2] - 1,
            self.drafter.target_hidden,
        )
        features = list(self.drafter.features(out).float().split(lengths))
        if not self.top_k:
            return TargetRows(features)
        probs, ids = out.logits.softmax(dim=-1).topk(self.top_k, dim=-1)
        return TargetRows(features, list(probs.split(lengths)), list(ids.split(lengths)))

    def padded(self, sequences: Sequence[list[int]]) -> tuple[torch.Tensor, SoftLabels | None]:
        """[B, L, F] fp32, zero past each sequence's end; and the soft labels with ``top_k``."""
        rows = self.rows(sequences)
        soft = None
        if rows.top_probs is not None and rows.top_ids is not None:
            soft = SoftLabels(pad_rows(rows.top_probs), pad_rows(rows.top_ids))  # int64
        return pad_rows(rows.features), soft


def pad_rows(rows: Sequence[torch.Tensor]) -> torch.Tensor:
    """Per-sequence [len_i, F] rows as [B, L, F], zero past each sequence's end: fp32 for
    floating rows (features, cached in fp16, or probabilities), int64 for token ids."""
    width = max(r.shape[0] for r in rows)
    dtype = torch.float32 if rows[0].is_floating_point() else torch.int64
    out = torch.zeros((len(rows), width, rows[0].shape[-1]), dtype=dtype, device=rows[0].device)
    for i, r in enumerate(rows):
        out[i, : r.shape[0]] = r
    return out

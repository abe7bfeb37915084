"""The frozen target over training sequences: what a drafter conditions on, per token.

One ragged forward per batch, one row per sequence from position 0, through the serving
model, paged KV cache and torch backend; features come from the drafter's own
``features`` so that training and serving read the same hidden states.
"""

from __future__ import annotations

from collections.abc import Sequence

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


class TargetFeatures:
    """Runs ``target`` (no grad) and returns ``drafter.features`` in fp32."""

    def __init__(self, target: Llama3Model, drafter: Drafter, device: torch.device) -> None:
        self.target, self.drafter, self.device = target, drafter, device
        self.backend = TorchAttentionBackend()
        self._kv: PagedKVCache | None = None

    def _cache(self, num_blocks: int) -> PagedKVCache:
        if self._kv is None or self._kv.num_blocks < num_blocks:
            params = KVCacheParams.from_config(self.target.config, BLOCK_SIZE)
            self._kv = None  # free the old pools first
            self._kv = PagedKVCache(params, num_blocks, self.device)
        return self._kv

    @torch.no_grad()
    def ragged(self, sequences: Sequence[list[int]]) -> list[torch.Tensor]:
        """Per sequence: [len_i, F] fp32."""
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
            layout.input_row_offsets[1:2] - 1,  # one logit row, unused
            self.drafter.target_hidden,
        )
        return list(self.drafter.features(out).float().split(lengths))

    def padded(self, sequences: Sequence[list[int]]) -> torch.Tensor:
        """[B, L, F] fp32, zero past each sequence's end."""
        return pad_rows(self.ragged(sequences))


def pad_rows(rows: Sequence[torch.Tensor]) -> torch.Tensor:
    """Per-sequence [len_i, F] features (fp32 or cached fp16) as [B, L, F] fp32, zero past
    each sequence's end."""
    width = max(r.shape[0] for r in rows)
    out = torch.zeros((len(rows), width, rows[0].shape[-1]), device=rows[0].device)
    for i, r in enumerate(rows):
        out[i, : r.shape[0]] = r
    return out

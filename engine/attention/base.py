"""The seam between models and attention kernels."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch


@dataclass
class BatchLayout:
    """Where a ragged batch's tokens sit, in the sequence and in the paged KV cache.

    Built by the model runner once per step and shared by every layer.
    """

    input_row_offsets: torch.Tensor  # [B+1] int64: row b owns tokens offsets[b]:offsets[b+1]
    positions: torch.Tensor  # [T] int64: position of each token in its sequence
    slot_mapping: (
        torch.Tensor
    )  # [T] int64: flat KV slot (block * block_size + offset) each token writes
    context_lens: torch.Tensor  # [B] int64: KV length of each row after this step
    block_tables: torch.Tensor  # [B, max_blocks] int64: block ids per row, padded with 0
    block_size: int
    max_query_len: int  # host-side bound on tokens per row (fixed per captured shape)
    max_context_len: int  # host-side bound on KV length per row
    is_causal_prefill: bool = False  # every row starts at position 0 (no earlier KV to read)


class AttentionBackend(Protocol):
    """Computes attention for one layer, reading and writing the paged KV cache."""

    def build_metadata(self, layout: BatchLayout) -> Any: ...

    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        metadata: Any,
    ) -> torch.Tensor:  # [T, Hq, D]
        ...

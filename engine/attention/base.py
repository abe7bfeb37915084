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
    is_causal: bool = True  # False: every query sees its row's whole context (DFlash blocks)
    # False when max_context_len is only a host-side bound (speculative steps, where each
    # row's length is known on the device only): no shortcut may assume it is exact.
    is_max_context_exact: bool = True
    # Host-side copies of each row's query and context length, where the host built the
    # batch (None where they live on the device only): a backend may split a ragged mix
    # of prompt chunks and decode rows into groups instead of padding every row.
    query_lens: list[int] | None = None
    context_lens_host: list[int] | None = None

    @classmethod
    def uniform(
        cls,
        positions: torch.Tensor,  # [B, S] int64, consecutive per row
        block_tables: torch.Tensor,  # [B, M] int64
        block_size: int,
        max_context_len: int,  # host bound on every row's last position + 1
        *,
        is_causal: bool = True,
    ) -> BatchLayout:
        """S tokens per row, all computed on the device (no host synchronisation)."""
        b, s = positions.shape
        return cls(
            input_row_offsets=torch.arange(b + 1, device=positions.device) * s,
            positions=positions.reshape(-1),
            slot_mapping=slots_for(block_tables, positions, block_size).reshape(-1),
            context_lens=positions[:, -1] + 1,
            block_tables=block_tables,
            block_size=block_size,
            max_query_len=s,
            max_context_len=max_context_len,
            is_causal=is_causal,
            is_max_context_exact=False,
        )


def slots_for(block_tables: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Flat KV slot of each position, on the device: ``[B, S]`` tables and positions ``[B, S]``."""
    blocks = block_tables.gather(1, positions // block_size)
    return blocks * block_size + positions % block_size


def write_kv(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T]
) -> None:
    """Stores K/V in their slots without attending (DFlash writes its context this way)."""
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v)


class AttentionBackend(Protocol):
    """Computes attention for one layer, reading and writing the paged KV cache."""

    def build_metadata(self, layout: BatchLayout) -> Any: ...

    def write_kv(
        self,
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,  # [T]
    ) -> None:
        """Stores K/V without attending (DFlash context); a training backend keeps them."""
        ...

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

"""Attention through the Triton kernels (``kernels/triton/attention.py``): the KV store,
then one paged-attention launch for the whole ragged batch, prompt chunks and decode rows
alike, straight from the pools (no gather). No host synchronisation, so a captured CUDA
graph can hold it; on CPU it runs only under Triton's interpreter (tests)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention.base import BatchLayout

# Rows of at most this many tokens (decode, verify) may split their context (flash-decoding);
# longer ones (prompt chunks) already give the GPU enough programs.
SPLIT_MAX_QUERY_LEN = 16


@dataclass
class TritonAttentionMetadata:
    slot_mapping: torch.Tensor  # [T] where each token's K/V goes
    block_tables: torch.Tensor  # [B, M]
    context_lens: torch.Tensor  # [B] KV length of each row after this step
    input_row_offsets: torch.Tensor  # [B + 1]
    positions: torch.Tensor  # [T]
    max_query_len: int  # host bound: the kernel's grid
    is_causal: bool
    num_splits: int | None  # None: from the shapes; 1 for prompt chunks


class TritonAttentionBackend:
    """Paged attention in Triton, for CUDA (and the interpreter on CPU)."""

    def __init__(self) -> None:
        from kernels.triton import attention  # imports triton: only when this backend runs

        self._kernels = attention

    def build_metadata(self, layout: BatchLayout) -> TritonAttentionMetadata:
        is_short = layout.max_query_len <= SPLIT_MAX_QUERY_LEN
        return TritonAttentionMetadata(
            slot_mapping=layout.slot_mapping,
            block_tables=layout.block_tables,
            context_lens=layout.context_lens,
            input_row_offsets=layout.input_row_offsets,
            positions=layout.positions,
            max_query_len=layout.max_query_len,
            is_causal=layout.is_causal,
            num_splits=None if is_short else 1,
        )

    def write_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        self._kernels.store_kv(k, v, k_cache, v_cache, slot_mapping)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: TritonAttentionMetadata,
    ) -> torch.Tensor:
        self._kernels.store_kv(k, v, k_cache, v_cache, metadata.slot_mapping)
        return self._kernels.paged_attention(
            q,
            k_cache,
            v_cache,
            metadata.block_tables,
            metadata.context_lens,
            metadata.input_row_offsets,
            metadata.positions,
            q.shape[-1] ** -0.5,
            metadata.is_causal,
            max_query_len=metadata.max_query_len,
            num_splits=metadata.num_splits,
        )

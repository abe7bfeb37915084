"""Attention through flash-attn's varlen kernel over the paged KV cache.

UNTESTED: written against flash-attn 2's documented API (``flash_attn_varlen_func`` with
``block_table``, flash-attn >= 2.6) and not yet run, since flash-attn is not installed on
any machine here (PyPI has only a source distribution that needs a long CUDA build). Its
paged KV needs a block size that is a multiple of 256 (``supports``); the K/V store is the
Triton kernel's. One call serves prompt chunks and decode/verify rows: queries are the last
tokens of their row's context, which is where flash-attn aligns its causal mask when a row
has fewer queries than keys.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.attention.base import BatchLayout

PAGE_MULTIPLE = 256  # flash-attn 2's paged KV: page_block_size % 256 == 0


def is_importable() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def supports(block_size: int) -> bool:
    return block_size % PAGE_MULTIPLE == 0


@dataclass
class FlashAttnMetadata:
    slot_mapping: torch.Tensor  # [T]
    cu_seqlens_q: torch.Tensor  # [B + 1] int32: the query offsets
    cu_seqlens_k: torch.Tensor  # [B + 1] int32: cumulative context lengths
    block_table: torch.Tensor  # [B, M] int32
    max_seqlen_q: int
    max_seqlen_k: int  # host bound
    is_causal: bool
    positions: torch.Tensor  # [T] int64: the Triton element-wise path's RoPE reads them


class FlashAttnBackend:
    """flash-attn on CUDA (untested, see the module docstring)."""

    def __init__(self, block_size: int) -> None:
        if not supports(block_size):
            raise ValueError(
                f"attention backend flash_attn: block_size {block_size} is not a multiple of "
                f"{PAGE_MULTIPLE} (flash-attn's paged KV); use 'triton'"
            )
        from flash_attn import flash_attn_varlen_func

        from kernels.triton import attention

        self._varlen = flash_attn_varlen_func
        self._store_kv = attention.store_kv

    def build_metadata(self, layout: BatchLayout) -> FlashAttnMetadata:
        cu_k = F.pad(layout.context_lens.cumsum(0), (1, 0))
        return FlashAttnMetadata(
            slot_mapping=layout.slot_mapping,
            cu_seqlens_q=layout.input_row_offsets.to(torch.int32),
            cu_seqlens_k=cu_k.to(torch.int32),
            block_table=layout.block_tables.to(torch.int32),
            max_seqlen_q=layout.max_query_len,
            max_seqlen_k=layout.max_context_len,
            is_causal=layout.is_causal,
            positions=layout.positions,
        )

    def write_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        self._store_kv(k, v, k_cache, v_cache, slot_mapping)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: FlashAttnMetadata,
    ) -> torch.Tensor:
        self._store_kv(k, v, k_cache, v_cache, metadata.slot_mapping)
        out: torch.Tensor = self._varlen(
            q,
            k_cache,
            v_cache,
            cu_seqlens_q=metadata.cu_seqlens_q,
            cu_seqlens_k=metadata.cu_seqlens_k,
            max_seqlen_q=metadata.max_seqlen_q,
            max_seqlen_k=metadata.max_seqlen_k,
            softmax_scale=q.shape[-1] ** -0.5,
            causal=metadata.is_causal,
            block_table=metadata.block_table,
        )
        return out

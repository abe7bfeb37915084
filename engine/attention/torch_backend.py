"""Attention in plain torch: write new K/V into their slots, gather each row's KV, one SDPA
call per group of rows of similar query length."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F

from engine.attention.base import BatchLayout, write_kv
from kernels.cpu import paged_attention


@dataclass
class PagedRows:
    """What ``kernels.cpu.paged_attention`` reads instead of gathered K/V and a mask."""

    block_tables: torch.Tensor  # [B, M]
    context_lens: torch.Tensor  # [B]
    row_offsets: torch.Tensor  # [B + 1]
    positions: torch.Tensor  # [T]
    is_causal: bool


@dataclass
class TorchAttentionMetadata:
    slot_mapping: torch.Tensor  # [T]
    query_gather: (
        torch.Tensor
    )  # [B * Q] index into the T tokens (padding repeats a row's last token)
    query_scatter: torch.Tensor  # [T] index of each token inside the padded [B * Q] layout
    kv_slots: torch.Tensor  # [B, C] flat KV slot of every context position (padding reads slot 0)
    mask: torch.Tensor | None  # [B, 1, Q, C] bool, True where a query may attend; None: all
    num_rows: int
    max_query_len: int
    single_fresh_row: bool  # one row starting at position 0: plain causal attention, no gather
    # A mixed batch runs as groups of rows instead: (the group's token indices [Tg] into
    # the T tokens, its metadata). Empty: the rows above are the whole batch.
    groups: list[tuple[torch.Tensor, TorchAttentionMetadata]] = field(default_factory=list)
    # Set where the CPU kernel attends these rows straight from the paged cache.
    paged: PagedRows | None = None


# Rows with at most this many query tokens (decode rows, speculative verification) attend
# apart from longer prompt chunks in a mixed batch, rather than padded to the longest chunk.
# Measured: a 64-row continuous batch where requests join mid-way spent 45% of its time in
# attention padded to the joining prompts' length.
SHORT_QUERY_LEN = 16


def split_rows(query_lens: list[int]) -> list[list[int]]:
    """Rows grouped so that short (decode) rows are not padded to long (prompt) rows:
    [rows] per group, in row order; one group when splitting saves nothing. (Each group
    also pads only to its own longest context, ``row_subset``.)"""
    short = [r for r, n in enumerate(query_lens) if n <= SHORT_QUERY_LEN]
    long = [r for r, n in enumerate(query_lens) if n > SHORT_QUERY_LEN]
    if not short or not long:
        return [list(range(len(query_lens)))]
    return [short, long]


def row_subset(layout: BatchLayout, rows: list[int]) -> tuple[torch.Tensor, BatchLayout]:
    """The token indices of ``rows`` and the layout of those rows alone (host-known lengths)."""
    assert layout.query_lens is not None and layout.context_lens_host is not None
    offsets = layout.input_row_offsets
    device = offsets.device
    host_offsets = [0]
    for n in layout.query_lens:
        host_offsets.append(host_offsets[-1] + n)
    tokens = [t for r in rows for t in range(host_offsets[r], host_offsets[r + 1])]
    sub_offsets = [0]
    for r in rows:
        sub_offsets.append(sub_offsets[-1] + layout.query_lens[r])
    token_index = torch.tensor(tokens, dtype=torch.int64, device=device)
    row_index = torch.tensor(rows, dtype=torch.int64, device=device)
    sub = replace(
        layout,
        input_row_offsets=torch.tensor(sub_offsets, dtype=torch.int64, device=device),
        positions=layout.positions[token_index],
        slot_mapping=layout.slot_mapping[token_index],
        context_lens=layout.context_lens[row_index],
        block_tables=layout.block_tables[row_index],
        max_query_len=max(layout.query_lens[r] for r in rows),
        max_context_len=max(layout.context_lens_host[r] for r in rows),
        query_lens=None,  # a group is not split again
        context_lens_host=None,
    )
    return token_index, sub


class TorchAttentionBackend:
    """Reference backend: correct for any ragged mix of prefill chunks and decode rows."""

    def build_metadata(self, layout: BatchLayout) -> TorchAttentionMetadata:
        if layout.query_lens is not None and layout.context_lens_host is not None:
            groups = split_rows(layout.query_lens)
            if len(groups) > 1:
                parts = [row_subset(layout, rows) for rows in groups]
                none = layout.slot_mapping[:0]
                return TorchAttentionMetadata(
                    slot_mapping=layout.slot_mapping,
                    query_gather=none,
                    query_scatter=none,
                    kv_slots=none,
                    mask=None,
                    num_rows=len(layout.query_lens),
                    max_query_len=layout.max_query_len,
                    single_fresh_row=False,
                    groups=[(index, self.build_metadata(sub)) for index, sub in parts],
                )
        offsets = layout.input_row_offsets
        device = offsets.device
        num_rows = offsets.numel() - 1
        q_len, c_len = layout.max_query_len, layout.max_context_len
        if q_len == 1 and layout.positions.numel() == num_rows:
            # Decode rows only, one token each: both maps are the identity (what the
            # general case below computes then), without its dozen small ops.
            query_gather = torch.arange(num_rows, device=device)
            query_scatter = torch.arange(num_rows, device=device)
        else:
            starts, lens = offsets[:-1], offsets[1:] - offsets[:-1]  # [B]
            local = torch.arange(q_len, device=device)  # [Q]
            local = torch.minimum(local[None, :], (lens - 1).clamp(min=0)[:, None])  # [B, Q]
            query_gather = (starts[:, None] + local).reshape(-1)
            token_row = torch.repeat_interleave(
                torch.arange(num_rows, device=device), lens, output_size=layout.positions.numel()
            )  # [T]
            token_local = torch.arange(layout.positions.numel(), device=device) - starts[token_row]
            query_scatter = token_row * q_len + token_local

        ctx = torch.arange(c_len, device=device)  # [C]
        block_idx = (ctx // layout.block_size).clamp(max=layout.block_tables.shape[1] - 1)
        kv_slots = layout.block_tables[:, block_idx] * layout.block_size + (ctx % layout.block_size)
        kv_slots = torch.where(ctx[None, :] < layout.context_lens[:, None], kv_slots, 0)  # [B, C]

        single_fresh_row = layout.is_causal_prefill and layout.is_causal and num_rows == 1
        # One row of one token sees its whole context: no mask needed when C is exact.
        single_decode_row = num_rows == 1 and q_len == 1 and layout.is_max_context_exact
        mask = None
        if not (single_fresh_row or single_decode_row):
            mask = (ctx[None, None, :] < layout.context_lens[:, None, None]).expand(
                num_rows, q_len, c_len
            )
            if layout.is_causal:
                q_pos = layout.positions[query_gather].view(num_rows, q_len)  # [B, Q]
                mask = mask & (ctx[None, None, :] <= q_pos[:, :, None])
            mask = mask.unsqueeze(1)  # [B, 1, Q, C]
        paged = None
        if (
            device.type == "cpu"
            and q_len <= SHORT_QUERY_LEN
            and not single_fresh_row
            and paged_attention.available()
        ):
            paged = PagedRows(
                layout.block_tables,
                layout.context_lens,
                offsets,
                layout.positions,
                layout.is_causal,
            )
        return TorchAttentionMetadata(
            slot_mapping=layout.slot_mapping,
            query_gather=query_gather,
            query_scatter=query_scatter,
            kv_slots=kv_slots,
            mask=mask,
            num_rows=num_rows,
            max_query_len=q_len,
            single_fresh_row=single_fresh_row,
            paged=paged,
        )

    def write_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        write_kv(k, v, k_cache, v_cache, slot_mapping)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: TorchAttentionMetadata,
    ) -> torch.Tensor:
        write_kv(k, v, k_cache, v_cache, metadata.slot_mapping)
        if not metadata.groups:
            return self.attend(q, k, v, k_cache, v_cache, metadata)
        out = torch.empty_like(q)
        for index, part in metadata.groups:
            out.index_copy_(
                0, index, self.attend(q[index], k[index], v[index], k_cache, v_cache, part)
            )
        return out

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: TorchAttentionMetadata,
    ) -> torch.Tensor:
        """Attention of rows whose K/V are already in the cache (``k``/``v``: this step's)."""
        num_heads, head_dim = q.shape[1], q.shape[2]
        paged = metadata.paged
        if paged is not None and head_dim in (64, 128) and q.dtype == k_cache.dtype:
            return paged_attention.attention(
                q,
                k_cache,
                v_cache,
                paged.block_tables,
                paged.context_lens,
                paged.row_offsets,
                paged.positions,
                head_dim**-0.5,
                paged.is_causal,
            )
        k_flat = k_cache.view(-1, k_cache.shape[2], head_dim)
        v_flat = v_cache.view(-1, v_cache.shape[2], head_dim)

        # From tensor shapes, not the host ints: under torch.compile they stay symbolic, so
        # one graph serves every batch size and query length.
        b = metadata.kv_slots.shape[0]
        qn = metadata.query_gather.shape[0] // b
        is_uniform = b * qn == q.shape[0]  # every row has qn tokens: padding is the identity
        qp = q if is_uniform else q[metadata.query_gather]
        qp = qp.view(b, qn, num_heads, head_dim).transpose(1, 2)
        if metadata.single_fresh_row:
            # The row's K/V are exactly this step's: no gather, plain causal attention.
            kp, vp = k.unsqueeze(0).transpose(1, 2), v.unsqueeze(0).transpose(1, 2)
            out = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, enable_gqa=True)
        else:
            kp = k_flat[metadata.kv_slots].transpose(1, 2)  # [B, Hkv, C, D]
            vp = v_flat[metadata.kv_slots].transpose(1, 2)
            if qp.device.type == "cpu" and qp.dtype != torch.float32:
                # CPU SDPA with a mask is slower in bf16 than in fp32, casts included
                # (bench/RESULTS.md); it accumulates in fp32 either way.
                out = F.scaled_dot_product_attention(
                    qp.float(), kp.float(), vp.float(), attn_mask=metadata.mask, enable_gqa=True
                ).to(qp.dtype)
            else:
                out = F.scaled_dot_product_attention(
                    qp, kp, vp, attn_mask=metadata.mask, enable_gqa=True
                )
        out = out.transpose(1, 2).reshape(b * qn, num_heads, head_dim)  # [B*Q, Hq, D]
        return out if is_uniform else out[metadata.query_scatter]

"""Attention over the paged KV cache in plain torch: every query against its row's gathered
context, in fp32. The reference of ``kernels.triton.attention``."""

from __future__ import annotations

import torch


def store_kv(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] flat slot (block * block_size + offset); < 0: skipped
) -> None:
    """Writes each token's K/V into its slot; a negative slot (a padded row) writes nothing.
    (The boolean selection synchronises with the host; the Triton kernel does not.)"""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k_cache.view(-1, *k_cache.shape[2:])[slots] = k[keep]
    v_cache.view(-1, *v_cache.shape[2:])[slots] = v[keep]


def paged_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, M] block ids per row
    context_lens: torch.Tensor,  # [B] KV length of each row, this step's K/V written
    input_row_offsets: torch.Tensor,  # [B + 1]: row b owns tokens offsets[b]:offsets[b+1]
    positions: torch.Tensor,  # [T] position of each token in its sequence
    scale: float,
    is_causal: bool,
    *,
    max_query_len: int,  # host bound on tokens per row (the kernel's grid)
    num_splits: int | None = None,  # the kernel's split-K; the reference has no splits
) -> torch.Tensor:  # [T, Hq, D], q's dtype
    """Each token attends to its row's context ``[0, context_len)``, up to its own position
    when causal. A token with nothing to attend to (an empty padded row) gets zeros."""
    del max_query_len, num_splits
    t, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    num_rows, max_blocks = block_tables.shape
    offsets = input_row_offsets.long()
    row = torch.searchsorted(offsets[1:], torch.arange(t, device=q.device), right=True)
    row = row.clamp(max=num_rows - 1)  # [T]
    ctx = torch.arange(max_blocks * block_size, device=q.device)  # [C]
    slots = block_tables.long()[:, ctx // block_size] * block_size + ctx % block_size  # [B, C]
    keys = k_cache.reshape(-1, num_kv_heads, head_dim)[slots[row]].float()  # [T, C, Hkv, D]
    values = v_cache.reshape(-1, num_kv_heads, head_dim)[slots[row]].float()
    group = num_heads // num_kv_heads
    keys = keys.repeat_interleave(group, dim=2)  # [T, C, Hq, D]
    values = values.repeat_interleave(group, dim=2)
    scores = torch.einsum("thd,tchd->thc", q.float(), keys) * scale  # [T, Hq, C]
    visible = ctx[None, :] < context_lens.long()[row][:, None]  # [T, C]
    if is_causal:
        visible = visible & (ctx[None, :] <= positions.long()[:, None])
    scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # an empty row: all -inf -> 0
    return torch.einsum("thc,tchd->thd", probs, values).to(q.dtype)


def prefill_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]: this step's keys, written into the cache first
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T]
    block_tables: torch.Tensor,  # [B, M]
    context_lens: torch.Tensor,  # [B] KV length of each row after this step
    input_row_offsets: torch.Tensor,  # [B + 1]
    positions: torch.Tensor,  # [T]
    scale: float,
    is_causal: bool,
    *,
    max_query_len: int,
) -> torch.Tensor:  # [T, Hq, D]
    """Ragged prompt chunks: this step's K/V into their slots, then each token over its
    row's cached prefix and the chunk (causal within the chunk)."""
    store_kv(k, v, k_cache, v_cache, slot_mapping)
    return paged_attention(
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        input_row_offsets,
        positions,
        scale,
        is_causal,
        max_query_len=max_query_len,
    )

"""Attention over the paged KV cache: decode and verify rows (1..K+1 new tokens each) with
split-K (flash-decoding), and ragged prefill chunks with the paged KV write.

One kernel serves both. A program takes one row, one KV head and one split of the row's
context; its query tile packs (new token, query head of the group) pairs, so GQA reads each
K/V tile once for the whole group. Keys are found per position through the block table
(``block_table[row, pos // block_size] * block_size + pos % block_size``), so any block
size works. With more than one split, each split writes a normalised partial output and
its log-sum-exp, and a second kernel combines them.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

BLOCK_N = 32  # context positions per tile
_MAX_SPLITS = 16
_SPLIT_MIN_LEN = 2 * BLOCK_N  # context positions a split keeps at least
_INTERPRETER_SMS = 128  # on CPU (the interpreter): the width splits are planned for
# Running max before any key: finite, so a row with no key gives no NaN (a constexpr: jit
# functions read no other globals).
_EMPTY: tl.constexpr = tl.constexpr(-1.0e30)


@triton.jit
def _attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    part_o_ptr,
    part_lse_ptr,
    block_tables_ptr,
    context_lens_ptr,
    offsets_ptr,
    positions_ptr,
    scale,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_bt,
    num_tokens,
    num_heads,
    block_size,
    split_len,
    num_m_tiles,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    IS_SPLIT: tl.constexpr,
    PRECISION: tl.constexpr,
):
    row = tl.program_id(0) // num_m_tiles
    m_tile = tl.program_id(0) % num_m_tiles
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    start = tl.load(offsets_ptr + row).to(tl.int64)
    row_len = tl.load(offsets_ptr + row + 1).to(tl.int64) - start
    ctx_len = tl.load(context_lens_ptr + row).to(tl.int64)

    m = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)  # (token in row, head in group) pairs
    tok = m // GROUP
    head = kv_head * GROUP + m % GROUP
    m_valid = tok < row_len
    token = start + tok
    d = tl.arange(0, BLOCK_D)
    d_valid = d < HEAD_DIM
    q = tl.load(
        q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=m_valid[:, None] & d_valid[None, :],
        other=0.0,
    )
    q_pos = tl.load(positions_ptr + token, mask=m_valid, other=-1).to(tl.int64)

    hi = ctx_len
    if IS_CAUSAL:  # no key past the tile's last query
        hi = tl.minimum(hi, tl.max(q_pos, 0) + 1)
    lo = split.to(tl.int64) * split_len
    hi = tl.minimum(hi, lo + split_len)

    m_i = tl.full([BLOCK_M], _EMPTY, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n_start in range(lo, hi, BLOCK_N):
        n = n_start + tl.arange(0, BLOCK_N)
        n_valid = n < hi
        block = tl.load(
            block_tables_ptr + row * stride_bt + n // block_size, mask=n_valid, other=0
        ).to(tl.int64)
        slot_in_block = n % block_size
        kv_mask = n_valid[:, None] & d_valid[None, :]
        k = tl.load(
            k_cache_ptr
            + block[:, None] * stride_kb
            + slot_in_block[:, None] * stride_ks
            + kv_head * stride_kh
            + d[None, :],
            mask=kv_mask,
            other=0.0,
        )
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [M, N] fp32
        visible = n_valid[None, :] & m_valid[:, None]
        if IS_CAUSAL:
            visible = visible & (n[None, :] <= q_pos[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_cache_ptr
            + block[:, None] * stride_vb
            + slot_in_block[:, None] * stride_vs
            + kv_head * stride_vh
            + d[None, :],
            mask=kv_mask,
            other=0.0,
        )
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # a query with no key: zeros
    o_mask = m_valid[:, None] & d_valid[None, :]
    if IS_SPLIT:
        lse = tl.where(l_i > 0, m_i + tl.log(tl.where(l_i > 0, l_i, 1.0)), _EMPTY)
        at = split * num_tokens + token  # part_o [S, T, Hq, D] fp32, part_lse [S, T, Hq]
        tl.store(part_lse_ptr + at * num_heads + head, lse, mask=m_valid)
        tl.store(
            part_o_ptr + (at * num_heads + head)[:, None] * HEAD_DIM + d[None, :], o, mask=o_mask
        )
    else:
        tl.store(
            out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=o_mask,
        )


@triton.jit
def _combine_kernel(
    out_ptr,
    part_o_ptr,
    part_lse_ptr,
    stride_ot,
    stride_oh,
    num_tokens,
    num_heads,
    NUM_SPLITS: tl.constexpr,
    SPLITS_POW2: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """out = sum_s exp(lse_s - max) o_s / sum_s exp(lse_s - max), per (token, head)."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    s = tl.arange(0, SPLITS_POW2)
    d = tl.arange(0, BLOCK_D)
    s_valid = s < NUM_SPLITS
    at = (s * num_tokens + token) * num_heads + head  # [S]
    lse = tl.load(part_lse_ptr + at, mask=s_valid, other=float("-inf"))
    w = tl.exp(lse - tl.max(lse, 0))  # [S]; padding splits weigh 0
    o = tl.load(
        part_o_ptr + at[:, None] * HEAD_DIM + d[None, :],
        mask=s_valid[:, None] & (d < HEAD_DIM)[None, :],
        other=0.0,
    )
    out = tl.sum(o * w[:, None], 0) / tl.sum(w, 0)
    tl.store(
        out_ptr + token * stride_ot + head * stride_oh + d,
        out.to(out_ptr.dtype.element_ty),
        mask=d < HEAD_DIM,
    )


def default_num_splits(num_programs: int, max_ctx: int, num_sms: int) -> int:
    """Splits of the context, from shapes only (a captured graph keeps them): enough that
    the programs cover the device's ``num_sms`` once, each split keeping at least two tiles
    of positions; one where the rows and heads alone do. At batch 1 a decode row has one
    program per KV head (8 for Llama-3-8B): unsplit, 8 of an H200's 132 SMs walk the whole
    context one tile after another."""
    if num_programs >= num_sms:
        return 1
    return max(1, min(_MAX_SPLITS, -(-num_sms // num_programs), max_ctx // _SPLIT_MIN_LEN))


@functools.cache
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; a nominal width on CPU."""
    if device.type != "cuda":
        return _INTERPRETER_SMS
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def query_tiles(max_query_len: int, group: int) -> tuple[int, int]:
    """(BLOCK_M, tiles per row and KV head): a tile packs (new token, query head of the
    group) pairs."""
    pairs = max(1, max_query_len) * group
    block_m = min(64, max(16, triton.next_power_of_2(pairs)))
    return block_m, triton.cdiv(pairs, block_m)


def planned_splits(
    num_rows: int,
    num_kv_heads: int,
    max_query_len: int,
    group: int,
    max_ctx: int,
    device: torch.device,
    num_splits: int | None = None,
) -> tuple[int, int]:
    """(splits, positions per split) ``paged_attention`` runs: ``num_splits`` as planned,
    or the default (``default_num_splits``) for None."""
    if num_splits is None:
        num_programs = num_rows * query_tiles(max_query_len, group)[1] * num_kv_heads
        num_splits = default_num_splits(num_programs, max_ctx, num_sms(device))
    return plan_splits(max_ctx, num_splits)


def plan_splits(max_ctx: int, num_splits: int) -> tuple[int, int]:
    """(splits that hold positions, positions per split): whole tiles per split."""
    split_len = triton.cdiv(triton.cdiv(max_ctx, max(1, num_splits)), BLOCK_N) * BLOCK_N
    return triton.cdiv(max_ctx, split_len), split_len


def store_kv(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] flat slot (block * block_size + offset); < 0: skipped
) -> None:
    """Writes each token's K/V into its slot, both in one kernel; a negative slot (a padded
    row) writes nothing."""
    t, num_kv_heads, head_dim = k.shape
    if t == 0:
        return
    for x in (k, v, k_cache, v_cache):
        assert x.stride(-1) == 1
    _store_kernel[(t,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        k_cache.shape[1],
        NUM_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )


@triton.jit
def _store_one(src_ptr, cache_ptr, token, slot, stride_st, stride_sh, stride_cb, stride_cs,
               stride_ch, block_size, h, d, mask):  # fmt: skip
    x = tl.load(src_ptr + token * stride_st + h[:, None] * stride_sh + d[None, :], mask=mask)
    where = (slot // block_size) * stride_cb + (slot % block_size) * stride_cs
    tl.store(
        cache_ptr + where + h[:, None] * stride_ch + d[None, :],
        x.to(cache_ptr.dtype.element_ty),
        mask=mask & (slot >= 0),
    )


@triton.jit
def _store_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slots_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    block_size,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + token).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (h < NUM_HEADS)[:, None] & (d < HEAD_DIM)[None, :]
    _store_one(k_ptr, k_cache_ptr, token, slot, stride_kt, stride_kh, stride_kcb, stride_kcs,
               stride_kch, block_size, h, d, mask)  # fmt: skip
    _store_one(v_ptr, v_cache_ptr, token, slot, stride_vt, stride_vh, stride_vcb, stride_vcs,
               stride_vch, block_size, h, d, mask)  # fmt: skip


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
    num_splits: int | None = None,  # split-K over the context; None: from the shapes
) -> torch.Tensor:  # [T, Hq, D], q's dtype
    """Each token attends to its row's context ``[0, context_len)``, up to its own position
    when causal. No host synchronisation: the grid comes from shapes and host bounds (the
    longest context is the block table's width times the block size)."""
    t, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_rows, max_blocks = block_tables.shape
    out = torch.empty_like(q)
    if t == 0 or num_rows == 0:
        return out
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    assert block_tables.stride(-1) == 1
    group = num_heads // num_kv_heads
    block_m, num_m_tiles = query_tiles(max_query_len, group)
    max_ctx = max_blocks * block_size
    num_splits, split_len = planned_splits(
        num_rows, num_kv_heads, max_query_len, group, max_ctx, q.device, num_splits
    )
    is_split = num_splits > 1
    part_o = part_lse = out  # unused unless split
    if is_split:
        part_o = q.new_empty((num_splits, t, num_heads, head_dim), dtype=torch.float32)
        part_lse = q.new_empty((num_splits, t, num_heads), dtype=torch.float32)
    _attention_kernel[(num_rows * num_m_tiles, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        out,
        part_o,
        part_lse,
        block_tables,
        context_lens,
        input_row_offsets,
        positions,
        scale,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        t,
        num_heads,
        block_size,
        split_len,
        num_m_tiles,
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_M=block_m,
        BLOCK_N=BLOCK_N,
        BLOCK_D=triton.next_power_of_2(head_dim),
        IS_CAUSAL=is_causal,
        IS_SPLIT=is_split,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )
    if is_split:
        _combine_kernel[(t, num_heads)](
            out,
            part_o,
            part_lse,
            out.stride(0),
            out.stride(1),
            t,
            num_heads,
            NUM_SPLITS=num_splits,
            SPLITS_POW2=triton.next_power_of_2(num_splits),
            HEAD_DIM=head_dim,
            BLOCK_D=triton.next_power_of_2(head_dim),
        )
    return out


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
    row's cached prefix and the chunk (causal within the chunk); query tiles of 64 pairs,
    each stopping at its last query's position."""
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
        num_splits=1,
    )

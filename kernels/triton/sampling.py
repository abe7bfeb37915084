"""Sampling and speculative acceptance without host synchronisation, one program per row,
with the random uniforms passed in; and those uniforms themselves, keyed on each row's
seed and position (``row_keys``, ``uniform``: the torch reference's bits, one kernel each).

Thresholds are found without sorting the vocabulary: the k-th largest probability, or the
nucleus's least one, is the largest bit pattern v (non-negative floats order as their
patterns) whose tokens at or above v weigh at least the target; a binary search over v's
31 bits, one pass over the row per bit. Top-p mass is fixed point (``MASS_ONE``), so sums
do not depend on their order. A draw is the first index whose cumulative weight exceeds
u * total, the cumulative sum running tile by tile.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MASS_ONE = 1 << 40
BLOCK_V = 1024  # vocabulary entries per tile


@triton.jit
def _weight_at_or_above(probs_ptr, vocab, cand, USE_MASS: tl.constexpr, BLOCK: tl.constexpr):
    """Tokens (or their fixed-point mass) whose probability's bit pattern is >= cand."""
    total = tl.zeros([], tl.int64)
    for start in range(0, vocab, BLOCK):
        i = start + tl.arange(0, BLOCK)
        p = tl.load(probs_ptr + i, mask=i < vocab, other=0.0)
        at_or_above = (p.to(tl.int32, bitcast=True) >= cand) & (i < vocab)
        ones = tl.full([BLOCK], 1, tl.int64)
        w = (p * 1099511627776.0).to(tl.int64) if USE_MASS else ones  # MASS_ONE
        total += tl.sum(tl.where(at_or_above, w, 0), 0)
    return total


@triton.jit
def _threshold(probs_ptr, vocab, target, USE_MASS: tl.constexpr, BLOCK: tl.constexpr):
    """The largest bit pattern v whose tokens at or above v weigh at least target."""
    prefix = tl.zeros([], tl.int32)
    for i in range(31):
        cand = prefix | (1 << (30 - i))
        weight = _weight_at_or_above(probs_ptr, vocab, cand, USE_MASS, BLOCK)
        prefix = tl.where(weight >= target, cand, prefix)
    return prefix


@triton.jit
def _filter_kernel(
    logits_ptr,
    out_ptr,
    temperature_ptr,
    top_k_ptr,
    top_p_ptr,
    min_p_ptr,
    vocab,
    stride_l,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_ptr = logits_ptr + row * stride_l
    p_ptr = out_ptr + row * vocab
    temp = tl.load(temperature_ptr + row)
    temp = tl.where(temp > 0, temp, 1.0)
    top_k = tl.load(top_k_ptr + row)
    top_p = tl.load(top_p_ptr + row)
    min_p = tl.load(min_p_ptr + row)

    top = tl.full([], float("-inf"), tl.float32)
    for start in range(0, vocab, BLOCK):
        i = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + i, mask=i < vocab, other=float("-inf")).to(tl.float32) / temp
        top = tl.maximum(top, tl.max(x, 0))
    denom = tl.zeros([], tl.float32)
    for start in range(0, vocab, BLOCK):
        i = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + i, mask=i < vocab, other=float("-inf")).to(tl.float32) / temp
        denom += tl.sum(tl.exp(x - top), 0)
    for start in range(0, vocab, BLOCK):  # the unfiltered probabilities, for the searches
        i = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + i, mask=i < vocab, other=float("-inf")).to(tl.float32) / temp
        tl.store(p_ptr + i, tl.exp(x - top) / denom, mask=i < vocab)

    floor = tl.zeros([], tl.int32)  # keep the tokens whose pattern is >= floor
    if (top_k > 0) & (top_k < vocab):
        floor = _threshold(p_ptr, vocab, top_k.to(tl.int64), False, BLOCK)
    if top_p < 1.0:
        kept_mass = tl.full([], 1099511627776, tl.int64)  # MASS_ONE
        if top_k > 0:
            kept_mass = _weight_at_or_above(p_ptr, vocab, floor, True, BLOCK)
        target = tl.maximum((top_p.to(tl.float64) * kept_mass.to(tl.float64)).to(tl.int64), 1)
        floor = tl.maximum(floor, _threshold(p_ptr, vocab, target, True, BLOCK))
    floor = tl.maximum(floor, (min_p * (1.0 / denom)).to(tl.int32, bitcast=True))

    kept = tl.zeros([], tl.float32)
    for start in range(0, vocab, BLOCK):
        i = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + i, mask=i < vocab, other=float("-inf")).to(tl.float32) / temp
        p = tl.load(p_ptr + i, mask=i < vocab, other=0.0)
        kept += tl.sum(tl.where(p.to(tl.int32, bitcast=True) >= floor, tl.exp(x - top), 0.0), 0)
    for start in range(0, vocab, BLOCK):
        i = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + i, mask=i < vocab, other=float("-inf")).to(tl.float32) / temp
        p = tl.load(p_ptr + i, mask=i < vocab, other=0.0)
        e = tl.where(p.to(tl.int32, bitcast=True) >= floor, tl.exp(x - top), 0.0)
        tl.store(p_ptr + i, e / kept, mask=i < vocab)


def filtered_probs(
    logits: torch.Tensor,  # [B, V]
    temperature: torch.Tensor,  # [B] fp32; <= 0: greedy (scaled by 1 here)
    top_k: torch.Tensor,  # [B] int64, 0 = off
    top_p: torch.Tensor,  # [B] fp32, 1 = off
    min_p: torch.Tensor,  # [B] fp32, 0 = off
) -> torch.Tensor:  # [B, V] fp32
    """Temperature, then top-k, top-p (on the top-k set), min-p; the kept tokens' softmax."""
    b, vocab = logits.shape
    assert logits.stride(-1) == 1
    out = torch.empty((b, vocab), dtype=torch.float32, device=logits.device)
    if b:
        _filter_kernel[(b,)](
            logits,
            out,
            temperature.float().contiguous(),
            top_k.long().contiguous(),
            top_p.float().contiguous(),
            min_p.float().contiguous(),
            vocab,
            logits.stride(0),
            BLOCK=min(BLOCK_V, triton.next_power_of_2(vocab)),
        )
    return out


@triton.jit
def _draw(p_ptr, q_ptr, vocab, u, is_residual, BLOCK: tl.constexpr):
    """The first index whose cumulative weight exceeds u * total; weights p, or
    max(0, p - q) when is_residual (p where that has no mass). Never a zero-weight index."""
    total_p = tl.zeros([], tl.float32)
    total_r = tl.zeros([], tl.float32)
    for start in range(0, vocab, BLOCK):
        i = start + tl.arange(0, BLOCK)
        p = tl.load(p_ptr + i, mask=i < vocab, other=0.0)
        r = tl.maximum(p - tl.load(q_ptr + i, mask=i < vocab, other=0.0), 0.0)
        total_p = tl.max(total_p + tl.cumsum(p, 0), 0)  # the last cumulative value, as below
        total_r = tl.max(total_r + tl.cumsum(r, 0), 0)
    use_residual = is_residual & (total_r > 0)
    total = tl.where(use_residual, total_r, total_p)
    point = u * total
    carry = tl.zeros([], tl.float32)
    drawn = tl.zeros([], tl.int64)  # entries whose cumulative weight is <= point
    last = tl.zeros([], tl.int64)  # entries whose cumulative weight is < total
    for start in range(0, vocab, BLOCK):
        i = start + tl.arange(0, BLOCK)
        valid = i < vocab
        p = tl.load(p_ptr + i, mask=valid, other=0.0)
        r = tl.maximum(p - tl.load(q_ptr + i, mask=valid, other=0.0), 0.0)
        cdf = carry + tl.cumsum(tl.where(use_residual, r, p), 0)
        drawn += tl.sum((valid & (cdf <= point)).to(tl.int64), 0)
        last += tl.sum((valid & (cdf < total)).to(tl.int64), 0)
        carry = tl.max(cdf, 0)
    return tl.minimum(tl.minimum(drawn, last), vocab - 1)


@triton.jit
def _draw_kernel(weights_ptr, uniforms_ptr, out_ptr, vocab, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    u = tl.load(uniforms_ptr + row)
    w_ptr = weights_ptr + row * vocab
    token = _draw(w_ptr, w_ptr, vocab, u, tl.zeros([], tl.int1), BLOCK)
    tl.store(out_ptr + row, token)


def draw(
    weights: torch.Tensor,  # [N, V] non-negative, any positive total
    uniforms: torch.Tensor,  # [N] in (0, 1)
) -> torch.Tensor:  # [N] int64
    """The first index whose cumulative weight exceeds u * total; never a zero-weight one."""
    n, vocab = weights.shape
    weights = weights.float().contiguous()
    out = torch.empty(n, dtype=torch.int64, device=weights.device)
    if n:
        block = min(BLOCK_V, triton.next_power_of_2(vocab))
        _draw_kernel[(n,)](weights, uniforms.float().contiguous(), out, vocab, BLOCK=block)
    return out


def sample(
    logits: torch.Tensor,  # [B, V]
    temperature: torch.Tensor,  # [B]; <= 0: greedy
    top_k: torch.Tensor,  # [B]
    top_p: torch.Tensor,  # [B]
    min_p: torch.Tensor,  # [B]
    uniforms: torch.Tensor,  # [B]
) -> torch.Tensor:  # [B] int64
    """Argmax for greedy rows, else a draw from the filtered distribution."""
    drawn = draw(filtered_probs(logits, temperature, top_k, top_p, min_p), uniforms)
    return torch.where(temperature > 0, drawn, logits.argmax(dim=-1))


@triton.jit
def _rejection_kernel(
    p_ptr,
    q_ptr,
    drafts_ptr,
    draw_u_ptr,
    accept_u_ptr,
    num_ptr,
    next_ptr,
    num_drafts,
    vocab,
    HAS_DRAFT_PROBS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    k = num_drafts
    num = tl.zeros([], tl.int64)
    token = tl.zeros([], tl.int64)
    is_done = tl.zeros([], tl.int32)
    for j in range(0, k + 1):
        if is_done == 0:
            p_row = p_ptr + (row * (k + 1) + j) * vocab
            u = tl.load(draw_u_ptr + row * (k + 1) + j)
            is_draft = j < k
            x = tl.load(drafts_ptr + row * k + j, mask=is_draft, other=0).to(tl.int64)
            if HAS_DRAFT_PROBS:
                q_row = q_ptr + (row * k + j) * vocab
                p_x = tl.load(p_row + x, mask=is_draft, other=0.0)
                q_x = tl.load(q_row + x, mask=is_draft, other=0.0)
                r = tl.load(accept_u_ptr + row * k + j, mask=is_draft, other=1.0)
                if is_draft & (r * q_x < p_x):  # accept with probability min(1, p/q)
                    num += 1
                else:  # the residual at a rejection, p itself for the bonus
                    token = _draw(p_row, q_row, vocab, u, is_draft, BLOCK)
                    is_done = tl.full([], 1, tl.int32)
            else:
                s = _draw(p_row, p_row, vocab, u, tl.zeros([], tl.int1), BLOCK)
                if is_draft & (s == x):
                    num += 1
                else:
                    token = s
                    is_done = tl.full([], 1, tl.int32)
    tl.store(num_ptr + row, num)
    tl.store(next_ptr + row, token)


def rejection_sample(
    target_probs: torch.Tensor,  # [B, K+1, V] p: the target's filtered distributions
    draft_tokens: torch.Tensor,  # [B, K]
    draw_uniforms: torch.Tensor,  # [B, K+1]: one per position's draw
    draft_probs: torch.Tensor | None = None,  # [B, K, V] q; None: argmax (one-hot) drafts
    accept_uniforms: torch.Tensor | None = None,  # [B, K]: with draft_probs
) -> tuple[torch.Tensor, torch.Tensor]:  # num_accepted [B], next_tokens [B]
    """Lossless acceptance (see the reference's docstring); each row stops at its first
    rejection, so only the draws that are emitted are made."""
    b, s, vocab = target_probs.shape
    p = target_probs.float().contiguous()
    num = torch.empty(b, dtype=torch.int64, device=p.device)
    nxt = torch.empty(b, dtype=torch.int64, device=p.device)
    if b == 0:
        return num, nxt
    has_q = draft_probs is not None
    if has_q:
        assert draft_probs is not None and accept_uniforms is not None
        q = draft_probs.float().contiguous()
        accept_u = accept_uniforms.float().contiguous()
    else:
        q, accept_u = p, draw_uniforms.float()
    _rejection_kernel[(b,)](
        p,
        q,
        draft_tokens.contiguous(),
        draw_uniforms.float().contiguous(),
        accept_u,
        num,
        nxt,
        s - 1,
        vocab,
        HAS_DRAFT_PROBS=has_q,
        BLOCK=min(BLOCK_V, triton.next_power_of_2(vocab)),
    )
    return num, nxt


_KEYS_BLOCK = 256  # keys (or key-column pairs) per program


@triton.jit
def _mask32(x):
    # An int64 constant: a literal of 2**31 or more would be a uint32 in triton.
    return x & tl.full([], 0xFFFFFFFF, tl.int64)


@triton.jit
def _hash32(x):
    """lowbias32 on int64 values below 2**32: the reference's ops, the products' low 32 bits
    kept (an int64 product wraps modulo 2**64, whose low 32 bits are the product's)."""
    x = x ^ (x >> 16)
    x = _mask32(x * tl.full([], 0x7FEB352D, tl.int64))
    x = x ^ (x >> 15)
    x = _mask32(x * tl.full([], 0x846CA68B, tl.int64))
    return x ^ (x >> 16)


@triton.jit
def _row_keys_kernel(seeds_ptr, positions_ptr, out_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    is_in = i < n
    seeds = tl.load(seeds_ptr + i, mask=is_in, other=0)
    positions = tl.load(positions_ptr + i, mask=is_in, other=0)
    k = _hash32(_mask32(seeds))
    k = _hash32(k ^ _mask32(seeds >> 32))
    k = _hash32(k ^ _mask32(positions))
    tl.store(out_ptr + i, k, mask=is_in)


def row_keys(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """A 32-bit key per (seed, position): [N] int64, the reference's, in one kernel."""
    n = seeds.numel()
    out = torch.empty(n, dtype=torch.int64, device=seeds.device)
    if n:
        seeds = seeds.to(torch.int64).contiguous()
        positions = positions.to(torch.int64).contiguous()
        grid = (triton.cdiv(n, _KEYS_BLOCK),)
        _row_keys_kernel[grid](seeds, positions, out, n, BLOCK=_KEYS_BLOCK)
    return out


@triton.jit
def _uniform_kernel(keys_ptr, out_ptr, total, num, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # row * num + column
    is_in = i < total
    keys = tl.load(keys_ptr + i // num, mask=is_in, other=0)
    h = _hash32(_hash32(keys ^ (i % num)) ^ tl.full([], 0x5BD1E995, tl.int64))
    u = ((h >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)  # 23 bits: strictly below 1
    tl.store(out_ptr + i, u, mask=is_in)


def uniform(keys: torch.Tensor, num: int) -> torch.Tensor:
    """Uniform numbers in (0, 1), [N, num], the reference's bits, in one kernel."""
    n = keys.numel()
    out = torch.empty((n, num), dtype=torch.float32, device=keys.device)
    if n * num:
        keys = keys.to(torch.int64).contiguous()
        grid = (triton.cdiv(n * num, _KEYS_BLOCK),)
        _uniform_kernel[grid](keys, out, n * num, num, BLOCK=_KEYS_BLOCK)
    return out

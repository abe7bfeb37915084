"""Paged attention (decode, verify, prefill) and the KV store against the plain-torch
reference, through Triton's interpreter on CPU, in fp32 and fp16."""

from __future__ import annotations

import pytest
import torch

from kernels.reference import attention as ref
from kernels.triton import attention as tri

TOLERANCE = {torch.float32: 2e-6, torch.float16: 2e-3}


def make_case(
    query_lens: list[int],
    context_lens: list[int],
    *,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    block_size: int = 4,
    dtype: torch.dtype = torch.float32,
    spare_blocks: int = 0,
    device: torch.device | str = "cpu",
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """Rows of ``query_lens[b]`` tokens ending at position ``context_lens[b] - 1``, over
    per-layer pools with shuffled block ids (and blocks no row owns)."""
    g = torch.Generator().manual_seed(seed)
    b = len(query_lens)
    per_row = max(-(-n // block_size) for n in context_lens) + spare_blocks
    num_blocks = b * per_row + 3
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    case = {
        "q": torch.randn(sum(query_lens), num_heads, head_dim, generator=g).to(dtype),
        "k_cache": torch.randn(shape, generator=g).to(dtype),
        "v_cache": torch.randn(shape, generator=g).to(dtype),
        "block_tables": torch.randperm(num_blocks, generator=g)[: b * per_row].view(b, per_row),
        "context_lens": torch.tensor(context_lens),
        "input_row_offsets": torch.tensor([0, *query_lens]).cumsum(0),
        "positions": torch.cat(
            [torch.arange(c - n, c) for n, c in zip(query_lens, context_lens, strict=True)]
        ),
    }
    return {name: t.to(device) for name, t in case.items()}


def attend(module, case, is_causal: bool, max_query_len: int | None = None, **kw) -> torch.Tensor:
    if max_query_len is None:
        max_query_len = int((case["input_row_offsets"].diff()).max())
    scale = case["q"].shape[-1] ** -0.5
    return module.paged_attention(
        **case, scale=scale, is_causal=is_causal, max_query_len=max_query_len, **kw
    )


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    tol = TOLERANCE[got.dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


# (query tokens per row, KV length per row, q heads, kv heads, head dim, block size):
# decode rows, verify rows of K+1 tokens with an empty padded row, GQA 3 with a head dim
# that is no power of two, block sizes 1, 5 and 16 (the engine's default).
CASES = [
    ([1, 1, 1], [5, 16, 17], 4, 2, 16, 4),
    ([4, 0, 1, 3], [9, 0, 30, 3], 6, 2, 40, 5),
    ([6, 6], [6, 21], 4, 1, 16, 16),
    ([2, 3], [7, 12], 2, 2, 16, 1),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("query_lens,context_lens,hq,hkv,d,bs", CASES)
def test_decode_and_verify_match_the_reference(
    query_lens, context_lens, hq, hkv, d, bs, dtype, device
) -> None:
    case = make_case(query_lens, context_lens, num_heads=hq, num_kv_heads=hkv, head_dim=d,
                     block_size=bs, dtype=dtype, spare_blocks=1, device=device)  # fmt: skip
    for is_causal in (True, False):
        close(attend(tri, case, is_causal), attend(ref, case, is_causal))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_split_k_over_several_splits_matches_one_split_and_the_reference(dtype, device) -> None:
    """Contexts up to 100 positions in a 120-wide table: 3 splits requested give 2 splits of
    64 positions, 4 give 4 of 32; short rows leave later splits empty."""
    case = make_case([1, 3, 2, 1], [100, 70, 20, 1], block_size=4, dtype=dtype, spare_blocks=5,
                     device=device)  # fmt: skip
    max_ctx = case["block_tables"].shape[1] * 4
    num_splits, split_len = tri.plan_splits(max_ctx, 3)
    assert num_splits > 1 and split_len < 100
    split = attend(tri, case, True, num_splits=3)
    close(split, attend(ref, case, True))
    close(split, attend(tri, case, True, num_splits=1))
    close(attend(tri, case, False, num_splits=4), attend(ref, case, False))  # 4 splits
    # Each query one position early: its row's last key is masked, and the one-token row's
    # query at position -1 sees no key at all (zeros, not NaN).
    case["positions"] -= 1
    shifted = attend(tri, case, True, num_splits=4)
    close(shifted, attend(ref, case, True))
    assert torch.equal(shifted[-1], torch.zeros_like(shifted[-1]))


def test_splits_cover_the_sms_at_small_batches_and_keep_two_tiles_each() -> None:
    # Llama-3-8B's decode row at batch 1 on an H200 (132 SMs): a program per KV head (8),
    # a 560-position table: min(16, ceil(132 / 8), 560 // 64) = 8, planned as 6 of 96.
    assert tri.default_num_splits(8, 560, 132) == 8
    assert tri.plan_splits(560, 8) == (6, 96)
    assert tri.default_num_splits(64, 560, 132) == 3  # batch 8: ceil(132 / 64)
    assert tri.default_num_splits(132, 4096, 132) == 1  # the rows and heads cover them
    assert tri.default_num_splits(3, 8192, 132) == 16  # SmolLM2's 3 KV heads: at most 16
    assert tri.default_num_splits(8, 127, 132) == 1  # not two tiles a split
    assert tri.num_sms(torch.device("cpu")) == 128  # the interpreter's nominal width


def test_rows_read_only_their_blocks_and_grouped_heads_their_kv_head(device) -> None:
    case = make_case([2, 2], [20, 20], num_heads=4, num_kv_heads=2, device=device)
    before = attend(tri, case, True)
    case["k_cache"][case["block_tables"][1]] += 1.0  # every KV head of row 1
    case["v_cache"][case["block_tables"][0], :, 1] += 1.0  # KV head 1 of row 0: q heads 2-3
    after = attend(tri, case, True)
    assert torch.equal(after[:2, :2], before[:2, :2])
    assert not torch.equal(after[:2, 2:], before[:2, 2:])
    assert not torch.equal(after[2:], before[2:])


def test_int32_block_tables_and_strided_queries(device) -> None:
    """The engine's queries are a slice of the fused q/k projection (strided heads)."""
    case = make_case([3, 1], [11, 6], device=device)
    qk = torch.cat([case["q"], torch.randn_like(case["q"][:, :2])], dim=1)  # [T, Hq+2, D]
    strided = dict(case, q=qk[:, :4], block_tables=case["block_tables"].int())
    close(attend(tri, strided, True), attend(ref, case, True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_prefill_writes_the_chunk_then_attends_over_prefix_and_chunk(dtype, device) -> None:
    """Ragged chunks: a fresh prompt, a chunk after a cached prefix, a one-token row."""
    query_lens, context_lens, bs = [5, 9, 1], [5, 13, 8], 4
    case = make_case(query_lens, context_lens, num_heads=6, num_kv_heads=2, head_dim=16,
                     block_size=bs, dtype=dtype, device=device)  # fmt: skip
    t = sum(query_lens)
    g = torch.Generator().manual_seed(1)
    k = torch.randn(t, 2, 16, generator=g).to(dtype).to(device)
    v = torch.randn(t, 2, 16, generator=g).to(dtype).to(device)
    positions, tables = case["positions"], case["block_tables"]
    rows = torch.repeat_interleave(torch.arange(3, device=device), torch.tensor(query_lens,
                                   device=device))  # fmt: skip
    slots = tables[rows, positions // bs] * bs + positions % bs
    args = dict(case, k=k, v=v, slot_mapping=slots)
    caches = {m: (case["k_cache"].clone(), case["v_cache"].clone()) for m in (tri, ref)}
    outs = {}
    for m, (kc, vc) in caches.items():
        outs[m] = m.prefill_attention(
            **dict(args, k_cache=kc, v_cache=vc), scale=0.25, is_causal=True, max_query_len=9
        )
    assert torch.equal(caches[tri][0], caches[ref][0])
    assert torch.equal(caches[tri][1], caches[ref][1])
    assert torch.equal(caches[ref][0].view(-1, 2, 16)[slots], k)
    close(outs[tri], outs[ref])


def test_store_kv_writes_its_slots_and_skips_negative_ones(device) -> None:
    """A padded row's slot -1 writes nothing: every other slot keeps its value."""
    g = torch.Generator().manual_seed(3)
    k_cache = torch.randn(6, 4, 2, 16, generator=g).to(device)
    v_cache = torch.randn(6, 4, 2, 16, generator=g).to(device)
    k = torch.randn(5, 2, 16, generator=g).to(device)
    v = torch.randn(5, 2, 16, generator=g).to(device)
    slots = torch.tensor([7, -1, 0, 23, -1], device=device)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    ref.store_kv(k, v, want_k, want_v, slots)
    tri.store_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    assert torch.equal(k_cache.view(-1, 2, 16)[[7, 0, 23]], k[[0, 2, 3]])


def test_the_reference_matches_float64_attention_per_row() -> None:
    """The reference itself, row by row in float64 (what the CPU kernel's tests use)."""
    case = make_case([2, 3], [9, 14], num_heads=6, num_kv_heads=2, block_size=4)
    got = attend(ref, case, True).double()
    offsets = case["input_row_offsets"].tolist()
    for b, length in enumerate(case["context_lens"].tolist()):
        ctx = torch.arange(length)
        slots = case["block_tables"][b, ctx // 4] * 4 + ctx % 4
        k = case["k_cache"].view(-1, 2, 16)[slots].double().repeat_interleave(3, dim=1)
        v = case["v_cache"].view(-1, 2, 16)[slots].double().repeat_interleave(3, dim=1)
        rows = slice(offsets[b], offsets[b + 1])
        q = case["q"][rows].double()
        scores = torch.einsum("thd,chd->thc", q, k) * 0.25
        visible = ctx[None, :] <= case["positions"][rows][:, None]
        probs = scores.masked_fill(~visible[:, None, :], float("-inf")).softmax(-1)
        want = torch.einsum("thc,chd->thd", probs, v)
        torch.testing.assert_close(got[rows], want, rtol=0, atol=2e-6)

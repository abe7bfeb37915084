"""The paged-attention kernel (kernels/cpu) against float64 attention over gathered K/V."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.cpu import paged_attention
from tests.kernels.compile_count import CountingCompiler

pytestmark = pytest.mark.skipif(
    not paged_attention.available(),
    reason="needs an AVX2 CPU and a C++ compiler to build the kernel",
)


def make_case(
    query_lens: list[int],
    context_lens: list[int],
    *,
    num_heads: int = 9,
    num_kv_heads: int = 3,
    head_dim: int = 64,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """Rows of ``query_lens[b]`` tokens ending at position ``context_lens[b] - 1``, over
    caches with shuffled block ids (and spare blocks no row owns)."""
    g = torch.Generator().manual_seed(seed)
    b = len(query_lens)
    per_row = max(-(-n // block_size) for n in context_lens)
    num_blocks = b * per_row + 3
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    t = sum(query_lens)
    return {
        "q": torch.randn(t, num_heads, head_dim, generator=g).to(dtype),
        "k_cache": torch.randn(shape, generator=g).to(dtype),
        "v_cache": torch.randn(shape, generator=g).to(dtype),
        "block_tables": torch.randperm(num_blocks, generator=g)[: b * per_row].view(b, per_row),
        "context_lens": torch.tensor(context_lens),
        "row_offsets": torch.tensor([0, *query_lens]).cumsum(0),
        "positions": torch.cat(
            [torch.arange(c - n, c) for n, c in zip(query_lens, context_lens, strict=True)]
        ),
    }


def reference(case: dict[str, torch.Tensor], is_causal: bool) -> torch.Tensor:
    """Each token over its row's gathered context, in float64."""
    q, k_cache, v_cache = case["q"], case["k_cache"], case["v_cache"]
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    out = torch.empty(q.shape, dtype=torch.float64)
    offsets = case["row_offsets"].tolist()
    for b, length in enumerate(case["context_lens"].tolist()):
        ctx = torch.arange(length)
        slots = case["block_tables"][b, ctx // block_size] * block_size + ctx % block_size
        k = k_cache.view(-1, num_kv_heads, head_dim)[slots].double().transpose(0, 1)
        v = v_cache.view(-1, num_kv_heads, head_dim)[slots].double().transpose(0, 1)
        rows = slice(offsets[b], offsets[b + 1])
        mask = torch.ones(offsets[b + 1] - offsets[b], length, dtype=torch.bool)
        if is_causal:
            mask = ctx[None, :] <= case["positions"][rows][:, None]
        qb = q[rows].double().transpose(0, 1)  # [Hq, Q, D]
        attended = F.scaled_dot_product_attention(qb, k, v, attn_mask=mask, enable_gqa=True)
        out[rows] = attended.transpose(0, 1)
    return out


def run(case: dict[str, torch.Tensor], is_causal: bool) -> torch.Tensor:
    head_dim = case["q"].shape[-1]
    return paged_attention.attention(**case, scale=head_dim**-0.5, is_causal=is_causal)


# (query tokens per row, KV length per row): decode rows, verify rows of K+1 tokens, a mix
# with an empty row, contexts shorter than one block, ragged last blocks, long contexts.
CASES = [
    ([1], [1]),
    ([1, 1, 1], [5, 16, 17]),
    ([6, 6], [6, 300]),
    ([4, 0, 1, 8], [40, 7, 1000, 23]),
    ([16], [16]),
]


@pytest.mark.parametrize("query_lens,context_lens", CASES)
@pytest.mark.parametrize("is_causal", [True, False])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_fp32_equals_float64_attention(query_lens, context_lens, is_causal, head_dim) -> None:
    case = make_case(query_lens, context_lens, head_dim=head_dim)
    got = run(case, is_causal)
    assert got.dtype == torch.float32 and got.shape == case["q"].shape
    torch.testing.assert_close(got.double(), reference(case, is_causal), rtol=0, atol=2e-6)


@pytest.mark.parametrize("is_causal", [True, False])
def test_bf16_is_the_fp32_result_of_the_bf16_values_rounded_once(is_causal) -> None:
    case = make_case([1, 6, 3], [33, 70, 3], dtype=torch.bfloat16, seed=1)
    got = run(case, is_causal)
    assert got.dtype == torch.bfloat16
    as_fp32 = run(
        {name: t.float() if t.is_floating_point() else t for name, t in case.items()}, is_causal
    )
    # One rounding of the same fp32 numbers: equal, or one bf16 step apart where the fp32
    # value sits next to a rounding boundary (the exp differs in its last bits).
    diff = (got.float() - as_fp32.bfloat16().float()).abs()
    step = as_fp32.abs() * 2**-7
    assert bool((diff <= step).all())
    assert (diff > 0).float().mean().item() < 0.01


def test_queries_see_only_their_row_and_grouped_heads_read_their_kv_head() -> None:
    """Changing another row's cache, or another KV head, leaves a row's output alone."""
    case = make_case([2, 2], [20, 20], seed=2)
    before = run(case, True)
    row1_blocks = case["block_tables"][1]
    case["k_cache"][row1_blocks] += 1.0  # every KV head of row 1
    case["v_cache"][case["block_tables"][0], :, 2] += 1.0  # KV head 2 of row 0: q heads 6-8
    after = run(case, True)
    assert torch.equal(after[:2, :6], before[:2, :6])
    assert not torch.equal(after[:2, 6:], before[:2, 6:])
    assert not torch.equal(after[2:], before[2:])


@pytest.mark.parametrize("heads", [range(0, 2), range(2, 4), range(3, 4)])
def test_a_ranks_heads_of_a_shared_pool_read_as_their_own_copy(heads: range) -> None:
    """A tensor-parallel rank's caches are its heads of a pool holding every rank's
    (engine.executor.shared_kv): strided slots, the same result as a contiguous copy."""
    case = make_case([1, 4, 2], [30, 17, 64], num_heads=8, num_kv_heads=4, seed=3)
    group = case["q"].shape[1] // case["k_cache"].shape[2]
    part = {
        **case,
        "q": case["q"][:, heads.start * group : heads.stop * group].contiguous(),
        "k_cache": case["k_cache"][:, :, heads.start : heads.stop],
        "v_cache": case["v_cache"][:, :, heads.start : heads.stop],
    }
    assert not part["k_cache"].is_contiguous()
    copied = {
        **part,
        "k_cache": part["k_cache"].contiguous(),
        "v_cache": part["v_cache"].contiguous(),
    }
    assert torch.equal(run(part, True), run(copied, True))


def test_bad_arguments_say_what_is_wrong() -> None:
    case = make_case([1], [4])
    with pytest.raises(RuntimeError, match="head_dim 48"):
        paged_attention.attention(
            case["q"][..., :48].contiguous(),
            case["k_cache"][..., :48].contiguous(),
            case["v_cache"][..., :48].contiguous(),
            case["block_tables"],
            case["context_lens"],
            case["row_offsets"],
            case["positions"],
            0.1,
            True,
        )
    with pytest.raises(RuntimeError, match="share one dtype"):
        run({**case, "q": case["q"].bfloat16()}, True)
    with pytest.raises(RuntimeError, match="evenly spaced"):
        transposed = case["k_cache"].transpose(1, 2).contiguous().transpose(1, 2)
        run({**case, "k_cache": transposed, "v_cache": transposed}, True)
    with pytest.raises(RuntimeError, match="int64"):
        run({**case, "positions": case["positions"].int()}, True)
    with pytest.raises(RuntimeError, match="row_offsets must run from 0 to 1"):
        run({**case, "row_offsets": torch.tensor([0, 2])}, True)


def test_compiled_callers_see_one_graph_for_every_batch() -> None:
    compiler = CountingCompiler()

    @compiler.compile
    def f(case: dict[str, torch.Tensor]) -> torch.Tensor:
        return run(case, True) * 2

    # No size is 1 and no two sizes of the first batch coincide by chance (dynamo would
    # specialize those): the batch size, KV lengths and block-table width all change.
    for query_lens, context_lens in [
        ([1] * 4, [9, 100, 33, 20]),
        ([1] * 6, [130] * 6),
        ([1] * 8, [40] * 8),
    ]:
        case = make_case(query_lens, context_lens)
        assert torch.equal(f(case), run(case, True) * 2)
    assert compiler.count == 1

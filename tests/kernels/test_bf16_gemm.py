"""The bf16 GEMM (kernels/cpu) against fp32 products of the same bf16 numbers."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.models.layers import Linear, release_packed_weights, use_packed_gemm
from kernels.cpu import bf16_gemm
from tests.kernels.compile_count import CountingCompiler

pytestmark = pytest.mark.skipif(
    not bf16_gemm.available(), reason="needs an AVX2 CPU and a C++ compiler to build the kernel"
)


@pytest.fixture(params=[False, True], ids=["avx2", "bf16-dot"])
def dot(request: pytest.FixtureRequest) -> bool:
    """The panel layout: AVX2 FMAs, or AVX512-BF16 dot products where the CPU has them."""
    if request.param and not bf16_gemm.dot_supported():
        pytest.skip("this CPU has no AVX512-BF16")
    return bool(request.param)


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """fp32 products of the bf16 values, with float64 accumulation."""
    out = x.double() @ weight.double().T
    if bias is not None:
        out = out + bias.double()
    return out


# (out_features, in_features): panel-aligned, ragged last panel, odd K (AVX2 layout only),
# K not a multiple of 4 pairs, SmolLM2's shapes
SHAPES = [(16, 8), (37, 19), (37, 18), (960, 576), (576, 1536), (3072, 576), (5, 3)]
# every register tile of both layouts (up to 6 and 12 rows), and several tiles
ROWS = [1, 2, 3, 5, 6, 7, 12, 13, 40]


# (out_features, in_features, dot): the bf16-dot layout pairs k, so even K only
LAYOUT_SHAPES = [(n, k, False) for n, k in SHAPES] + [(n, k, True) for n, k in SHAPES if k % 2 == 0]


@pytest.mark.parametrize("out_features,in_features,dot", LAYOUT_SHAPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_output_equals_the_product_of_the_bf16_values(
    out_features: int, in_features: int, dot: bool, rows: int, dtype: torch.dtype
) -> None:
    """fp32 inputs too: the bf16-dot layout splits them into three exact bf16 parts."""
    if dot and not bf16_gemm.dot_supported():
        pytest.skip("this CPU has no AVX512-BF16")
    g = torch.Generator().manual_seed(out_features * 1000 + rows)
    weight = torch.randn(out_features, in_features, generator=g).bfloat16()
    bias = torch.randn(out_features, generator=g).bfloat16()
    x = torch.randn(rows, in_features, generator=g).to(dtype)
    got = bf16_gemm.linear(x, bf16_gemm.pack(weight, dot), bias, out_features)
    assert got.dtype == dtype and got.shape == (rows, out_features)
    want = reference(x, weight, bias)
    # fp32 accumulation in another order: relative to the sum of |terms|; a bf16 output
    # is also rounded once (at most half a unit in the 8th bit)
    scale = (x.double().abs() @ weight.double().abs().T) + 1
    tolerance = 1e-6 if dtype == torch.float32 else 2**-8 + 1e-6
    assert ((got.double() - want).abs() / scale).max().item() < tolerance


def test_fp32_inputs_keep_their_low_bits_in_the_bf16_dot_layout(dot: bool) -> None:
    """Inputs that bf16 cannot hold: 1 + 2^-20 times a one-hot weight gives it back."""
    weight = torch.eye(32).bfloat16()
    x = torch.full((3, 32), 1 + 2**-20) * torch.arange(1, 33)
    got = bf16_gemm.linear(x, bf16_gemm.pack(weight, dot), None, 32)
    assert torch.equal(got, x)


def test_the_default_layout_is_the_fastest_this_cpu_runs() -> None:
    packed = bf16_gemm.pack(torch.randn(40, 24).bfloat16())
    assert packed.shape == ((3, 12, 32) if bf16_gemm.dot_supported() else (3, 24, 16))
    assert bf16_gemm.pack(torch.randn(40, 25).bfloat16()).shape == (3, 25, 16)  # odd K


@pytest.mark.parametrize("rows", [1, 4, 6, 9, 13])
def test_bf16_output_is_the_fp32_result_rounded_once(rows: int, dot: bool) -> None:
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(3072, 576, generator=g).bfloat16()
    x = torch.randn(rows, 576, generator=g).bfloat16()
    packed = bf16_gemm.pack(weight, dot)
    got = bf16_gemm.linear(x, packed, None, 3072)
    assert got.dtype == torch.bfloat16
    as_fp32 = bf16_gemm.linear(x.float(), packed, None, 3072)
    assert torch.equal(got, as_fp32.bfloat16())  # round-to-nearest-even, as torch rounds


def test_rounding_ties_overflow_and_nan_as_torch_rounds(dot: bool) -> None:
    # identity weight, so each output is x + bias, computed in fp32 and rounded once
    values = torch.tensor([1.0, 1.0078125, 3.3895e38, -3.3895e38, 2.0, 0.0] + [0.0] * 10)
    bias = torch.tensor([2**-8, 2**-8, 3.0e36, -3.0e36, 3 * 2**-8, float("nan")] + [0.0] * 10)
    got = bf16_gemm.linear(
        values.bfloat16()[None], bf16_gemm.pack(torch.eye(16).bfloat16(), dot), bias.bfloat16(), 16
    )[0]
    want = (values.bfloat16().float() + bias.bfloat16().float()).bfloat16()
    # ties to even: 1 + 2^-8 -> 1.0, 1.0078125 + 2^-8 -> 1.015625; nearest:
    # 2 + 3 * 2^-8 -> 2.015625; past the largest finite bf16 -> inf
    assert got[:5].tolist() == [1.0, 1.015625, float("inf"), float("-inf"), 2.015625]
    assert torch.equal(got[:5], want[:5]) and got[5].isnan()


def test_leading_dims_and_non_contiguous_input(dot: bool) -> None:
    weight = torch.randn(40, 24).bfloat16()
    x = torch.randn(3, 24, 5).bfloat16().transpose(1, 2)  # [3, 5, 24], not contiguous
    packed = bf16_gemm.pack(weight, dot)
    got = bf16_gemm.linear(x, packed, None, 40)
    assert got.shape == (3, 5, 40)
    want = bf16_gemm.linear(x.reshape(15, 24).contiguous(), packed, None, 40)
    assert torch.equal(got.reshape(15, 40), want)


def test_mismatched_arguments_say_what_is_wrong(dot: bool) -> None:
    packed = bf16_gemm.pack(torch.randn(32, 8).bfloat16(), dot)
    with pytest.raises(RuntimeError, match="x has 9 features, the weight 8"):
        bf16_gemm.linear(torch.randn(2, 9), packed, None, 32)
    with pytest.raises(RuntimeError, match="N=40 does not match"):
        bf16_gemm.linear(torch.randn(2, 8), packed, None, 40)
    with pytest.raises(RuntimeError, match="2-D bfloat16 weight"):
        bf16_gemm.pack(torch.randn(32, 8), dot)
    if dot:
        with pytest.raises(RuntimeError, match="needs an even K, got K=7"):
            bf16_gemm.pack(torch.randn(32, 7).bfloat16(), dot)


def test_compiled_callers_see_one_graph_for_every_row_count_from_two(dot: bool) -> None:
    """No guard on the row count: one graph serves them all (dynamo specializes 1 row)."""
    weight = torch.randn(64, 32).bfloat16()
    packed = bf16_gemm.pack(weight, dot)
    compiler = CountingCompiler()

    @compiler.compile
    def f(x: torch.Tensor) -> torch.Tensor:
        return bf16_gemm.linear(x * 2, packed, None, 64).relu()

    for rows in (3, 2, 7, 30):
        x = torch.randn(rows, 32).bfloat16()
        want = bf16_gemm.linear(x * 2, packed, None, 64).relu()
        assert torch.equal(f(x), want)
    assert compiler.count == 1


def packed_linear(out_features: int, in_features: int, seed: int) -> Linear:
    torch.manual_seed(seed)
    linear = Linear(in_features, out_features, bias=True).bfloat16()
    use_packed_gemm(linear, "kernel")
    return linear


@pytest.mark.parametrize("start", [0, 16, 48, 20, 79])
def test_rows_from_start_equal_those_of_the_whole_product(start: int) -> None:
    """DFlash's context K/V: the kv rows of a fused qkv projection, on panels (from a
    panel boundary) or sliced from the whole product (elsewhere), before and after the
    native weight is released."""
    linear = packed_linear(80, 40, seed=start)
    x = torch.randn(7, 40).bfloat16()
    whole = linear(x)
    want = reference(x.float(), linear.weight.float(), linear.bias.float())[:, start:]
    got = linear.forward_rows(x, start)
    assert torch.equal(got, whole[:, start:])  # same columns, same accumulation order
    assert (got.double() - want).abs().max().item() < 0.05  # bf16 rounding of the output
    assert release_packed_weights(linear) == 80 * 40 * 2
    assert linear.weight.numel() == 0
    assert torch.equal(linear.forward_rows(x, start), got)
    assert torch.equal(linear(x), whole)


def test_release_keeps_weights_shared_with_another_parameter() -> None:
    """A tied lm_head keeps the embedding's weight; weights only the panels need go."""
    model = nn.Module()
    model.embed = nn.Embedding(64, 40).bfloat16()
    model.head = Linear(40, 64, bias=False).bfloat16()
    model.head.weight = model.embed.weight  # tied, as tie_word_embeddings does
    model.proj = Linear(40, 48, bias=False).bfloat16()
    other = nn.Module()  # a drafter, packed and released together with the target
    other.fc = Linear(80, 40, bias=True).bfloat16()
    use_packed_gemm(model, "kernel")
    use_packed_gemm(other, "kernel")
    x = torch.randn(3, 40).bfloat16()
    before = (model.head(x), model.proj(x), other.fc(torch.cat([x, x], dim=-1)))
    assert release_packed_weights(model, other) == (48 * 40 + 40 * 80) * 2
    assert model.head.weight is model.embed.weight and model.embed.weight.shape == (64, 40)
    assert model.proj.weight.numel() == 0 and other.fc.weight.numel() == 0
    after = (model.head(x), model.proj(x), other.fc(torch.cat([x, x], dim=-1)))
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert release_packed_weights(model, other) == 0  # nothing left to free

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


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """fp32 products of the bf16 values, with float64 accumulation."""
    out = x.double() @ weight.double().T
    if bias is not None:
        out = out + bias.double()
    return out


# (out_features, in_features): panel-aligned, ragged last panel, odd K, SmolLM2's shapes
SHAPES = [(16, 8), (37, 19), (960, 576), (576, 1536), (3072, 576), (5, 3)]
ROWS = [1, 2, 3, 5, 6, 7, 12, 13, 40]


@pytest.mark.parametrize("out_features,in_features", SHAPES)
@pytest.mark.parametrize("rows", ROWS)
def test_fp32_output_equals_the_product_of_the_bf16_values(
    out_features: int, in_features: int, rows: int
) -> None:
    g = torch.Generator().manual_seed(out_features * 1000 + rows)
    weight = torch.randn(out_features, in_features, generator=g).bfloat16()
    bias = torch.randn(out_features, generator=g).bfloat16()
    x = torch.randn(rows, in_features, generator=g)
    got = bf16_gemm.linear(x, bf16_gemm.pack(weight), bias, out_features)
    assert got.dtype == torch.float32 and got.shape == (rows, out_features)
    want = reference(x, weight, bias)
    # fp32 accumulation in another order: relative to the sum of |terms|
    scale = (x.double().abs() @ weight.double().abs().T) + 1
    assert ((got.double() - want).abs() / scale).max().item() < 1e-6


@pytest.mark.parametrize("rows", [1, 4, 6, 9])
def test_bf16_output_is_the_fp32_result_rounded_once(rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(3072, 576, generator=g).bfloat16()
    x = torch.randn(rows, 576, generator=g).bfloat16()
    packed = bf16_gemm.pack(weight)
    got = bf16_gemm.linear(x, packed, None, 3072)
    assert got.dtype == torch.bfloat16
    as_fp32 = bf16_gemm.linear(x.float(), packed, None, 3072)
    assert torch.equal(got, as_fp32.bfloat16())  # round-to-nearest-even, as torch rounds


def test_rounding_ties_overflow_and_nan_as_torch_rounds() -> None:
    # identity weight, so each output is x + bias, computed in fp32 and rounded once
    values = torch.tensor([1.0, 1.0078125, 3.3895e38, -3.3895e38, 2.0, 0.0] + [0.0] * 10)
    bias = torch.tensor([2**-8, 2**-8, 3.0e36, -3.0e36, 3 * 2**-8, float("nan")] + [0.0] * 10)
    got = bf16_gemm.linear(
        values.bfloat16()[None], bf16_gemm.pack(torch.eye(16).bfloat16()), bias.bfloat16(), 16
    )[0]
    want = (values.bfloat16().float() + bias.bfloat16().float()).bfloat16()
    # ties to even: 1 + 2^-8 -> 1.0, 1.0078125 + 2^-8 -> 1.015625; nearest:
    # 2 + 3 * 2^-8 -> 2.015625; past the largest finite bf16 -> inf
    assert got[:5].tolist() == [1.0, 1.015625, float("inf"), float("-inf"), 2.015625]
    assert torch.equal(got[:5], want[:5]) and got[5].isnan()


def test_leading_dims_and_non_contiguous_input() -> None:
    weight = torch.randn(40, 24).bfloat16()
    x = torch.randn(3, 24, 5).bfloat16().transpose(1, 2)  # [3, 5, 24], not contiguous
    got = bf16_gemm.linear(x, bf16_gemm.pack(weight), None, 40)
    assert got.shape == (3, 5, 40)
    want = bf16_gemm.linear(x.reshape(15, 24).contiguous(), bf16_gemm.pack(weight), None, 40)
    assert torch.equal(got.reshape(15, 40), want)


def test_mismatched_arguments_say_what_is_wrong() -> None:
    packed = bf16_gemm.pack(torch.randn(32, 8).bfloat16())
    with pytest.raises(RuntimeError, match="x has 9 features, the weight 8"):
        bf16_gemm.linear(torch.randn(2, 9), packed, None, 32)
    with pytest.raises(RuntimeError, match="N=40 does not match"):
        bf16_gemm.linear(torch.randn(2, 8), packed, None, 40)
    with pytest.raises(RuntimeError, match="2-D bfloat16 weight"):
        bf16_gemm.pack(torch.randn(32, 8))


def test_compiled_callers_see_one_graph_for_every_row_count_from_two() -> None:
    """No guard on the row count: one graph serves them all (dynamo specializes 1 row)."""
    weight = torch.randn(64, 32).bfloat16()
    packed = bf16_gemm.pack(weight)
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
    use_packed_gemm(linear, min_rows=2)
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
    use_packed_gemm(model, min_rows=2)
    use_packed_gemm(other, min_rows=2)
    x = torch.randn(3, 40).bfloat16()
    before = (model.head(x), model.proj(x), other.fc(torch.cat([x, x], dim=-1)))
    assert release_packed_weights(model, other) == (48 * 40 + 40 * 80) * 2
    assert model.head.weight is model.embed.weight and model.embed.weight.shape == (64, 40)
    assert model.proj.weight.numel() == 0 and other.fc.weight.numel() == 0
    after = (model.head(x), model.proj(x), other.fc(torch.cat([x, x], dim=-1)))
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert release_packed_weights(model, other) == 0  # nothing left to free

"""The block-FP8 dequantization kernel (kernels/cpu/fp8_dequant.cpp) against torch's
own float8 conversion: every one of the 256 float8_e4m3fn codes (subnormals, both zeros,
NaN), each row's block scales, bf16 and fp32 out, bit for bit."""

from __future__ import annotations

import pytest
import torch

from kernels.cpu import extension

pytestmark = pytest.mark.skipif(
    not extension.available(), reason="needs an AVX2 CPU and a C++ compiler to build the kernel"
)


def reference(weight: torch.Tensor, scale: torch.Tensor, block_k: int, dtype: torch.dtype):
    expanded = scale.repeat_interleave(block_k, dim=1)[:, : weight.shape[1]]
    return (weight.to(torch.float32) * expanded).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("rows", "cols", "block_k"), [(4, 256, 128), (3, 200, 16), (5, 72, 32)])
def test_every_code_equals_torchs_conversion(dtype, rows: int, cols: int, block_k: int) -> None:
    g = torch.Generator().manual_seed(rows * cols)
    codes = torch.cat([torch.arange(256), torch.randint(0, 256, (rows * cols,), generator=g)])
    weight = codes[: rows * cols].to(torch.uint8).view(rows, cols).view(torch.float8_e4m3fn)
    blocks = -(-cols // block_k)
    scale = 10 ** (torch.rand(rows, blocks, generator=g) * 4 - 2)  # 0.01 to 100
    got = torch.ops.tandem_cpu.fp8_dequant(weight, scale, block_k, dtype)
    want = reference(weight, scale, block_k, dtype)
    assert got.dtype == dtype and got.shape == (rows, cols)
    assert torch.equal(got.isnan(), want.isnan()) and bool(want.isnan().any()) == (
        rows * cols >= 127
    )
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    same = got.isnan() | (got.view(bits) == want.view(bits))
    assert bool(same.all())  # bit for bit, signed zeros included


def test_bad_arguments_say_what_is_wrong() -> None:
    weight = torch.zeros(2, 64, dtype=torch.float8_e4m3fn)
    scale = torch.ones(2, 1)
    with pytest.raises(RuntimeError, match="block_k 24 must be a positive multiple of 16"):
        torch.ops.tandem_cpu.fp8_dequant(weight, scale, 24, torch.float32)
    with pytest.raises(RuntimeError, match="scale must be a contiguous float32 \\[2, 2\\]"):
        torch.ops.tandem_cpu.fp8_dequant(weight, scale, 32, torch.float32)
    with pytest.raises(RuntimeError, match="float8_e4m3fn"):
        torch.ops.tandem_cpu.fp8_dequant(weight.float(), scale, 64, torch.float32)
    with pytest.raises(RuntimeError, match="out_dtype must be bfloat16 or float32"):
        torch.ops.tandem_cpu.fp8_dequant(weight, scale, 64, torch.float16)

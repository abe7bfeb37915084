"""Block-FP8 products on the GPU, W8A8, as DeepSeek-V3 was trained: the weight in
float8_e4m3fn with a float32 scale per row and block of ``block_k`` columns (how
``engine.fp8.Fp8Linear`` holds it), the activations quantized per token per ``block_k``
channels as they come, and every block's product in FP8 with an fp32 accumulator.

``quantize_per_token_group`` scales each token's group of ``group`` channels so that its
largest magnitude maps to 448 (float8_e4m3fn's largest finite value) and rounds to the
nearest FP8 value, ties to even: bit for bit ``(x / s).to(torch.float8_e4m3fn)`` with
``s = amax / 448`` (a NaN makes its group's scale and codes NaN). The rounding is computed
here in fp32 (``_round_to_e4m3``) and the FP8 bits are written from it (``_e4m3_bits``),
rather than left to Triton's own conversion: the interpreter's rounds values near a
binade's top down a whole binade (31.0 to 16.0), ties away from even, and NaN to 384.

``block_fp8_matmul`` multiplies block by block, ``out[m, n] = sum_g xs[m, g] * ws[n, g] *
(xq[m, g-block] . wq[n, g-block])``: a tile of rows times a tile of output columns per
program, one ``tl.dot`` of two FP8 tiles per group (Hopper's FP8 tensor cores), scaled and
added in fp32. Blocks of ``block_k`` columns must be a power of two from 32 to 256
(``supports``): ``tl.dot`` needs such a K, and one group is one K step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_MAX = 448.0


def supports(block_k: int) -> bool:
    """Whether ``block_fp8_matmul`` runs blocks of ``block_k`` columns."""
    return 32 <= block_k <= 256 and block_k & (block_k - 1) == 0


@triton.jit
def _round_to_e4m3(y):
    """``y`` (fp32, |y| <= 448 give or take a rounding) rounded to the nearest
    float8_e4m3fn value, ties to even, as an fp32 value that converts exactly."""
    a = tl.abs(y)
    bits = a.to(tl.int32, bitcast=True)
    # A normal value keeps 3 of fp32's 23 mantissa bits: add half of the dropped 20 bits'
    # unit, less one unless the kept lowest bit is odd (ties to even); a carry moves up the
    # exponent, as it should.
    kept_lsb = (bits >> 20) & 1
    normal = (((bits + 0x7FFFF + kept_lsb) >> 20) << 20).to(tl.float32, bitcast=True)
    # Below 2**-6 the steps are 2**-9: adding 2**23 to a * 2**9 (< 8) rounds it to an
    # integer, ties to even, in fp32's own rounding; both scalings are exact.
    scaled = a * 512.0
    subnormal = ((scaled + 8388608.0) - 8388608.0) * 0.001953125
    r = tl.minimum(tl.where(a < 0.015625, subnormal, normal), 448.0)  # 2**-6: least normal
    sign = y.to(tl.int32, bitcast=True) & -0x80000000  # kept on a zero too: -0.0 stays
    rounded = (r.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)
    return tl.where(y != y, y, rounded)  # NaN stays NaN (the GPU's min drops a NaN operand)


@triton.jit
def _e4m3_bits(y):
    """``y`` (fp32) rounded as ``_round_to_e4m3`` does, as float8_e4m3fn's bits (uint8):
    sign, 4 exponent bits (bias 7), 3 mantissa bits; below 2**-6, a multiple of 2**-9 with
    exponent 0; NaN 0x7F."""
    r = _round_to_e4m3(y)
    a = tl.abs(r)
    bits = a.to(tl.int32, bitcast=True)
    normal = (((bits >> 23) - 120) << 3) | ((bits >> 20) & 7)  # fp32's bias 127, FP8's 7
    subnormal = (tl.where(a < 0.015625, a, 0.0) * 512.0).to(tl.int32)  # NaN: not cast
    code = tl.where(a < 0.015625, subnormal, normal)
    code = tl.where(r != r, 0x7F, code)
    sign = (r.to(tl.int32, bitcast=True) >> 24) & 0x80
    return (code | sign).to(tl.uint8)


@triton.jit
def _quantize_kernel(
    x_ptr, q_ptr, scale_ptr, K, num_groups, GROUP: tl.constexpr, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)
    cols = group * GROUP + tl.arange(0, BLOCK)
    mask = (tl.arange(0, BLOCK) < GROUP) & (cols < K)
    x = tl.load(x_ptr + row * K + cols, mask=mask, other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(x), axis=0), 1e-10)
    has_nan = tl.sum((x != x).to(tl.int32), axis=0) > 0  # the GPU's max drops a NaN
    scale = tl.where(has_nan, float("nan"), tl.math.div_rn(amax, 448.0))
    tl.store(q_ptr + row * K + cols, _e4m3_bits(tl.math.div_rn(x, scale)), mask=mask)
    tl.store(scale_ptr + row * num_groups + group, scale)


def quantize_per_token_group(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(``x`` [M, K] in float8_e4m3fn, float32 scales [M, ceil(K / group)]): each row's
    groups of ``group`` channels scaled to FP8's range, ``x ~ q * scale``."""
    assert x.dim() == 2
    x = x.contiguous()
    m, k = x.shape
    num_groups = triton.cdiv(k, group)
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(m, num_groups, dtype=torch.float32, device=x.device)
    if m and k:
        _quantize_kernel[(m, num_groups)](
            x,
            q.view(torch.uint8),
            scale,
            k,
            num_groups,
            GROUP=group,
            BLOCK=triton.next_power_of_2(group),
        )
    return q, scale


@triton.jit
def _w8a8_kernel(
    a_ptr,
    a_scale_ptr,
    w_ptr,
    w_scale_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    num_groups,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
    rows64, cols64 = rows.to(tl.int64), cols.to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for g in range(0, num_groups):
        k = g * BLOCK_K + tl.arange(0, BLOCK_K)
        k_ok = k < K
        a = tl.load(
            a_ptr + rows64[:, None] * K + k[None, :],
            mask=row_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        w = tl.load(  # [BLOCK_K, BLOCK_N]: the weight's rows as columns
            w_ptr + cols64[None, :] * K + k[:, None],
            mask=k_ok[:, None] & col_ok[None, :],
            other=0.0,
        )
        a_scale = tl.load(a_scale_ptr + rows64 * num_groups + g, mask=row_ok, other=0.0)
        w_scale = tl.load(w_scale_ptr + cols64 * num_groups + g, mask=col_ok, other=0.0)
        block = tl.dot(a, w, out_dtype=tl.float32)
        acc += block * a_scale[:, None] * w_scale[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rows64[:, None] * N + cols64[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def block_fp8_matmul(
    x_q: torch.Tensor,  # [M, K] float8_e4m3fn
    x_scale: torch.Tensor,  # [M, G] float32
    weight: torch.Tensor,  # [N, K] float8_e4m3fn
    weight_scale: torch.Tensor,  # [N, G] float32: each row's scale per block of columns
    block_k: int,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` in ``out_dtype``, [M, N], from both sides' FP8 blocks."""
    if not supports(block_k):
        raise ValueError(f"block_k {block_k}: a power of two from 32 to 256 runs")
    m, k = x_q.shape
    n = weight.shape[0]
    groups = triton.cdiv(k, block_k)
    assert weight.shape[1] == k and x_scale.shape == (m, groups)
    assert weight_scale.shape == (n, groups)
    out = torch.empty(m, n, dtype=out_dtype, device=x_q.device)
    if m == 0 or n == 0:
        return out
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_n = 64 if m <= 16 else 128  # few rows: more programs across the columns
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _w8a8_kernel[grid](
        x_q.contiguous(),
        x_scale.contiguous(),
        weight.contiguous(),
        weight_scale.contiguous(),
        bias if bias is not None else out,
        out,
        m,
        n,
        k,
        groups,
        HAS_BIAS=bias is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
    )
    return out


def block_fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    block_k: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """A block-FP8 projection of ``x`` [..., K] in ``x``'s dtype: its tokens quantized per
    ``block_k`` channels, then ``block_fp8_matmul``."""
    shape = x.shape
    x_q, x_scale = quantize_per_token_group(x.reshape(-1, shape[-1]), block_k)
    out = block_fp8_matmul(x_q, x_scale, weight, weight_scale, block_k, x.dtype, bias)
    return out.view(*shape[:-1], weight.shape[0])

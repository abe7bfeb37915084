"""Fused element-wise kernels of a Llama layer: RMSNorm with the residual add, RoPE (the
llama3 or YaRN scaling lives in ``inv_freq``, YaRN's cos/sin factor is an argument),
SiLU-and-mul. One program per token; each rounds to the activation dtype where the
engine's layers do, so fp32 agrees to the last bits."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    new_residual_ptr,
    hidden,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64) * hidden
    i = tl.arange(0, BLOCK)
    mask = i < hidden
    x = tl.load(x_ptr + row + i, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        x = x + tl.load(residual_ptr + row + i, mask=mask, other=0.0)  # in x's dtype
        tl.store(new_residual_ptr + row + i, x, mask=mask)
    xf = x.to(tl.float32)
    h = xf * tl.rsqrt(tl.sum(xf * xf, 0) / hidden + eps)
    w = tl.load(weight_ptr + i, mask=mask, other=0.0)
    tl.store(out_ptr + row + i, w * h.to(x.dtype), mask=mask)


def rms_norm(
    x: torch.Tensor,  # [T, H]
    weight: torch.Tensor,  # [H], x's dtype
    eps: float,
    residual: torch.Tensor | None = None,  # [T, H]: added to x first
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight * rms_norm(x + residual), x + residual)."""
    assert x.is_contiguous() and (residual is None or residual.is_contiguous())
    t, hidden = x.shape
    out = torch.empty_like(x)
    new_residual = torch.empty_like(x) if residual is not None else x
    if t:
        _rms_norm_kernel[(t,)](
            x,
            residual if residual is not None else x,
            weight,
            out,
            new_residual,
            hidden,
            eps,
            HAS_RESIDUAL=residual is not None,
            BLOCK=triton.next_power_of_2(hidden),
        )
    return out, new_residual


@triton.jit
def _rope_kernel(
    x_ptr,
    out_ptr,
    positions_ptr,
    inv_freq_ptr,
    cos_sin_factor,
    stride_xt,
    stride_xh,
    num_heads,
    HALF: tl.constexpr,
    IS_INTERLEAVED: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.float32)
    j = tl.arange(0, BLOCK_HALF)
    j_valid = j < HALF
    angle = pos * tl.load(inv_freq_ptr + j, mask=j_valid, other=0.0)  # [D/2] fp32
    h = tl.arange(0, BLOCK_H)
    mask = (h < num_heads)[:, None] & j_valid[None, :]
    row = x_ptr + token * stride_xt + h[:, None] * stride_xh
    if IS_INTERLEAVED:  # pairs (x_2j, x_2j+1), turned into halves on the way out
        x1 = tl.load(row + 2 * j[None, :], mask=mask, other=0.0)
        x2 = tl.load(row + 2 * j[None, :] + 1, mask=mask, other=0.0)
    else:
        x1 = tl.load(row + j[None, :], mask=mask, other=0.0)
        x2 = tl.load(row + j[None, :] + HALF, mask=mask, other=0.0)
    # fp32 cos and sin times the factor (YaRN's; 1.0 is exact), rounded to x's dtype
    cos = (tl.cos(angle) * cos_sin_factor).to(x1.dtype)[None, :]
    sin = (tl.sin(angle) * cos_sin_factor).to(x1.dtype)[None, :]
    # [x1, x2] * cos + [x2, x1] * [-sin, sin]: the engine's products, in x's dtype
    out = out_ptr + token * num_heads * 2 * HALF + h[:, None] * 2 * HALF + j[None, :]
    tl.store(out, x1 * cos + x2 * -sin, mask=mask)
    tl.store(out + HALF, x2 * cos + x1 * sin, mask=mask)


def rope(
    x: torch.Tensor,  # [T, H, D]: queries and keys may come together
    positions: torch.Tensor,  # [T]
    inv_freq: torch.Tensor,  # [D/2] fp32, llama3 or YaRN scaling included
    cos_sin_factor: float = 1.0,  # YaRN's attention factor on cos and sin
    is_interleaved: bool = False,  # x's rotary dims as pairs (x0, x1), (x2, x3), ...
) -> torch.Tensor:  # [T, H, D], contiguous, rotated dims as halves
    """Rotates each pair (x_i, x_{i+D/2}) by position * inv_freq_i (each pair (x_2i,
    x_2i+1) when interleaved, written out as halves: DeepSeek's deinterleave, fused)."""
    t, num_heads, head_dim = x.shape
    assert x.stride(-1) == 1 and head_dim % 2 == 0
    out = x.new_empty((t, num_heads, head_dim))
    if t:
        _rope_kernel[(t,)](
            x,
            out,
            positions,
            inv_freq.float().contiguous(),
            float(cos_sin_factor),
            x.stride(0),
            x.stride(1),
            num_heads,
            HALF=head_dim // 2,
            IS_INTERLEAVED=is_interleaved,
            BLOCK_H=triton.next_power_of_2(num_heads),
            BLOCK_HALF=triton.next_power_of_2(head_dim // 2),
        )
    return out


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, inter, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = i < inter
    gate = tl.load(x_ptr + row * 2 * inter + i, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * 2 * inter + inter + i, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype)  # F.silu rounds here
    tl.store(out_ptr + row * inter + i, silu * up, mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
    """silu(gate) * up, gate and up the halves of x (the fused gate_up projection)."""
    assert x.is_contiguous()
    t, width = x.shape
    inter = width // 2
    out = x.new_empty((t, inter))
    if t and inter:
        block = min(1024, triton.next_power_of_2(inter))
        _silu_and_mul_kernel[(t, triton.cdiv(inter, block))](x, out, inter, BLOCK=block)
    return out

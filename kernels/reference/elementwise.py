"""RMSNorm with residual add, RoPE and SiLU-and-mul in plain torch, rounded where the
engine's layers round (``engine/models/layers.py``): the reference of
``kernels.triton.elementwise``."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(
    x: torch.Tensor,  # [T, H]
    weight: torch.Tensor,  # [H], x's dtype
    eps: float,
    residual: torch.Tensor | None = None,  # [T, H]: added to x first
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight * rms_norm(x + residual), x + residual): normalised in fp32, rounded to x's
    dtype, then scaled by the weight in that dtype (as transformers does)."""
    if residual is not None:
        x = x + residual
    h = F.rms_norm(x.float(), weight.shape, eps=eps)
    return weight * h.to(x.dtype), x


def rope(
    x: torch.Tensor,  # [T, H, D]: queries and keys may come together
    positions: torch.Tensor,  # [T]
    inv_freq: torch.Tensor,  # [D/2] fp32, llama3 or YaRN scaling included
    cos_sin_factor: float = 1.0,  # YaRN's attention factor on cos and sin
    is_interleaved: bool = False,  # x's rotary dims as pairs (x0, x1), (x2, x3), ...
) -> torch.Tensor:  # [T, H, D], rotated dims as halves
    """Rotates each pair (x_i, x_{i+D/2}) by position * inv_freq_i: the angle and its cosine
    and sine in fp32 (times ``cos_sin_factor``), rounded to x's dtype, the rotation in x's
    dtype. Interleaved dims are first reordered into halves (DeepSeek's deinterleave)."""
    freqs = positions.float()[:, None] * inv_freq.float()[None, :]  # [T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos() * cos_sin_factor, emb.sin() * cos_sin_factor
    half = x.shape[-1] // 2
    sin[:, :half] = -sin[:, :half]  # rotate_half's sign
    cos, sin = cos.to(x.dtype)[:, None], sin.to(x.dtype)[:, None]
    if is_interleaved:
        x = x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)
    t, h, d = x.shape
    swapped = x.reshape(t, h, 2, half).flip(2).reshape(t, h, d)
    return x * cos + swapped * sin


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
    """silu(gate) * up, gate and up the halves of x (the fused gate_up projection)."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up

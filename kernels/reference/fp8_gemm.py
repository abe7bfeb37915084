"""The W8A8 block-FP8 product in plain torch: the reference of ``kernels.triton.fp8_gemm``
(the same names and signatures; fp32 sums in another order)."""

from __future__ import annotations

import torch

FP8_MAX = 448.0


def quantize_per_token_group(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(``x`` [M, K] in float8_e4m3fn, float32 scales [M, ceil(K / group)]): each row's
    groups of ``group`` channels scaled so that their largest magnitude maps to 448, then
    rounded by torch's conversion (to nearest, ties to even)."""
    m, k = x.shape
    groups = -(-k // group)
    padded = torch.zeros(m, groups * group, device=x.device)
    padded[:, :k] = x.float()
    tiles = padded.view(m, groups, group)
    amax = tiles.abs().amax(dim=-1).clamp(min=1e-10)  # [M, G]
    # A true division, as the kernel's: CUDA's division by a Python number multiplies by
    # its reciprocal instead, one ulp off for about half the values.
    scale = amax / torch.full_like(amax, FP8_MAX)
    q = (tiles / scale[:, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(m, -1)[:, :k].contiguous(), scale


def block_fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,  # [N, K] float8_e4m3fn
    weight_scale: torch.Tensor,  # [N, G] float32
    block_k: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x`` [..., K] quantized as ``quantize_per_token_group`` does, times the weight,
    both dequantized, in fp32; rounded to ``x``'s dtype."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    k = x2.shape[1]
    q, scale = quantize_per_token_group(x2, block_k)
    x_deq = q.float() * scale.repeat_interleave(block_k, dim=1)[:, :k]
    w_deq = weight.float() * weight_scale.repeat_interleave(block_k, dim=1)[:, :k]
    out = x_deq @ w_deq.T
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).view(*shape[:-1], weight.shape[0])

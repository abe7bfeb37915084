"""Building blocks shared by the Llama-family models, numerically aligned with transformers."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import Llama3RopeScaling


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32 and cast back, as transformers does."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: Llama3RopeScaling | None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2], with the llama3 frequency-dependent scaling."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables [max_positions, head_dim] in the model dtype."""

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: Llama3RopeScaling | None,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.head_dim, self.max_positions = head_dim, max_positions
        self.theta, self.scaling, self.dtype = theta, scaling, dtype
        self.cos: torch.Tensor
        self.sin: torch.Tensor
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)
        self.reset_buffers(torch.empty(0).device)

    def reset_buffers(self, device: torch.device) -> None:
        if device.type == "meta":
            return
        inv_freq = rope_inv_freq(self.head_dim, self.theta, self.scaling)
        positions = torch.arange(self.max_positions, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]  # [P, D/2], fp32 as in transformers
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos().to(device=device, dtype=self.dtype)
        self.sin = emb.sin().to(device=device, dtype=self.dtype)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # q: [T, Hq, D], k: [T, Hkv, D], positions: [T]
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class GatedMLP(nn.Module):
    """SwiGLU MLP with gate and up projections fused into one matrix."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)

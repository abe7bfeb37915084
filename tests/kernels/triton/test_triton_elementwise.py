"""RMSNorm (+ residual), RoPE with llama3 scaling and SiLU-and-mul against their references
and against the engine's own layers, on CPU through Triton's interpreter."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.config import Llama3RopeScaling
from engine.deepseek_v3_config import YarnRopeScaling
from engine.models.deepseek_v3 import YarnRotaryEmbedding, deinterleave
from engine.models.layers import RMSNorm, RotaryEmbedding, rope_inv_freq
from kernels.reference import elementwise as ref
from kernels.triton import elementwise as tri

DTYPES = [torch.float32, torch.float16]
LLAMA3 = Llama3RopeScaling(
    factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64
)


def randn(*shape: int, dtype: torch.dtype, device: torch.device, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype).to(device)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_with_and_without_residual(dtype, device) -> None:
    """fp16 exact on CPU (the one fp32 rounding agrees; a GPU's rsqrt is approximate),
    fp32 within an ulp or two (sum order)."""
    x, residual = (
        randn(5, 40, dtype=dtype, device=device, seed=0),
        randn(5, 40, dtype=dtype, device=device, seed=1),
    )
    layer = RMSNorm(40, eps=1e-5).to(dtype).to(device)
    with torch.no_grad():
        layer.weight.copy_(randn(40, dtype=dtype, device=device, seed=2))
    tol = 1e-6 if dtype == torch.float32 else (0 if device.type == "cpu" else 1e-3)
    for res in (None, residual):
        out, new_residual = tri.rms_norm(x, layer.weight.detach(), 1e-5, res)
        want, want_residual = ref.rms_norm(x, layer.weight.detach(), 1e-5, res)
        assert torch.equal(new_residual, want_residual)
        torch.testing.assert_close(out, want, rtol=tol, atol=tol)
        with torch.no_grad():
            torch.testing.assert_close(want, layer(want_residual), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scaling", [LLAMA3, None])
def test_rope_matches_the_engine_rotation(dtype, scaling, device) -> None:
    """Queries and keys together [T, Hq+Hkv, D], positions past the scaling's original
    context, a head dim that is no power of two."""
    head_dim, theta = 40, 500000.0
    table = RotaryEmbedding(head_dim, 4096, theta, scaling, dtype)
    inv_freq = rope_inv_freq(head_dim, theta, scaling).to(device)
    x = randn(7, 5, head_dim, dtype=dtype, device=device, seed=3)
    positions = torch.tensor([0, 1, 5, 63, 100, 1000, 4095], device=device)
    cos, sin = table.cos.to(device)[positions], table.sin.to(device)[positions]
    engine = RotaryEmbedding.rotate(x, cos.unsqueeze(1), sin.unsqueeze(1))
    want = ref.rope(x, positions, inv_freq)
    assert torch.equal(want, engine)
    tol = 1e-6 if dtype == torch.float32 else 1e-3  # cos/sin of fp32 angles: ulps apart
    torch.testing.assert_close(tri.rope(x, positions, inv_freq), want, rtol=tol, atol=tol)


YARN = YarnRopeScaling(
    factor=4.0,
    original_max_position_embeddings=64,
    beta_fast=32.0,
    beta_slow=1.0,
    mscale=1.0,
    mscale_all_dim=0.8,
)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_interleaved", [True, False])
def test_yarn_rope_matches_deepseek_v3s_rotation(dtype, is_interleaved, device) -> None:
    """YaRN's frequencies and cos/sin factor (not 1), on MLA's strided query rope parts
    [T, heads, R] (a view into [T, heads, nope + R]), interleaved or split dims."""
    rope_dim, theta = 16, 10000.0
    table = YarnRotaryEmbedding(rope_dim, 4096, theta, YARN, dtype)
    inv_freq, factor = table.inv_freq()
    assert factor != 1.0
    q = randn(7, 3, 24 + rope_dim, dtype=dtype, device=device, seed=5)
    x = q[..., 24:]  # strided rows, as the latent attention splits them
    positions = torch.tensor([0, 1, 5, 63, 100, 1000, 4095], device=device)
    cos, sin = table.cos.to(device)[positions], table.sin.to(device)[positions]
    turned = deinterleave(x) if is_interleaved else x
    engine = RotaryEmbedding.rotate(turned.contiguous(), cos.unsqueeze(1), sin.unsqueeze(1))
    want = ref.rope(x, positions, inv_freq.to(device), factor, is_interleaved)
    assert torch.equal(want, engine)
    got = tri.rope(x, positions, inv_freq.to(device), factor, is_interleaved)
    tol = 1e-6 if dtype == torch.float32 else 1e-3
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_the_gated_mlp(dtype, device) -> None:
    x = randn(6, 2 * 37, dtype=dtype, device=device, seed=4) * 4
    want = ref.silu_and_mul(x)
    gate, up = x.split(37, dim=-1)
    assert torch.equal(want, F.silu(gate) * up)
    tol = 1e-6 if dtype == torch.float32 else 1e-3
    torch.testing.assert_close(tri.silu_and_mul(x), want, rtol=tol, atol=tol)

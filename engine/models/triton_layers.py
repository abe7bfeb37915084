"""The GPU path's layers: RMSNorm (with the residual add fused where a decoder layer adds
one before its norm), RoPE and SiLU-and-mul through ``kernels.triton.elementwise``.

``use_triton_kernels`` swaps them into a loaded model once, in place, sharing its
parameters, so the torch path keeps its own modules untouched (nothing is decided per
call). RoPE takes each token's position from the attention metadata: the Triton and
flash-attn backends' metadata carry ``positions``, the positions every caller looks the
rope tables up at (``BatchLayout.positions``). Rotary tables with a cos/sin factor (YaRN)
and DeepSeek-V3's latent attention keep their torch rotation.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch
from torch import nn

from engine.attention.base import AttentionBackend
from engine.models.layers import GatedMLP, RMSNorm, RotaryEmbedding
from engine.models.llama3 import Llama3Attention, Llama3DecoderLayer


class TritonRMSNorm(nn.Module):
    """``RMSNorm`` through the fused kernel; ``add_and_norm`` adds the residual first."""

    def __init__(self, norm: RMSNorm, ops: ModuleType) -> None:
        super().__init__()
        self.weight, self.eps, self._ops = norm.weight, norm.eps, ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        out, _ = self._ops.rms_norm(x.reshape(-1, shape[-1]).contiguous(), self.weight, self.eps)
        return out.view(shape)

    def add_and_norm(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual), [T, H] each, in one pass."""
        out: tuple[torch.Tensor, torch.Tensor] = self._ops.rms_norm(
            x.contiguous(), self.weight, self.eps, residual.contiguous()
        )
        return out


class TritonGatedMLP(nn.Module):
    """``GatedMLP`` with silu(gate) * up in one kernel over the fused projection."""

    def __init__(self, mlp: GatedMLP, ops: ModuleType) -> None:
        super().__init__()
        self.intermediate_size = mlp.intermediate_size
        self.gate_up_proj, self.down_proj, self._ops = mlp.gate_up_proj, mlp.down_proj, ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [..., 2I]
        act = self._ops.silu_and_mul(gate_up.reshape(-1, gate_up.shape[-1]).contiguous())
        return self.down_proj(act.view(*gate_up.shape[:-1], self.intermediate_size))


class TritonLlama3Attention(nn.Module):
    """``Llama3Attention`` with queries and keys rotated by the RoPE kernel."""

    def __init__(self, attn: Llama3Attention, inv_freq: torch.Tensor, ops: ModuleType) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = attn.num_heads, attn.num_kv_heads
        self.head_dim, self.q_size, self.kv_size = attn.head_dim, attn.q_size, attn.kv_size
        self.qkv_proj, self.o_proj, self._ops = attn.qkv_proj, attn.o_proj, ops
        self.inv_freq: torch.Tensor
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # [D/2] fp32

    def forward(
        self,
        x: torch.Tensor,  # [T, H_in]
        rope: tuple[torch.Tensor, torch.Tensor],  # unused: the kernel computes its angles
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        backend: AttentionBackend,
        attn_metadata: Any,  # with ``positions`` [T]
    ) -> torch.Tensor:
        t = x.shape[0]
        qk, v = self.qkv_proj(x).split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        qk = self._ops.rope(qk.view(t, -1, self.head_dim), attn_metadata.positions, self.inv_freq)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = v.view(t, self.num_kv_heads, self.head_dim)
        out = backend.forward(q, k, v, kv_cache[0], kv_cache[1], attn_metadata)  # [T, Hq, D]
        return self.o_proj(out.reshape(t, self.q_size))


class TritonLlama3DecoderLayer(nn.Module):
    """``Llama3DecoderLayer`` whose post-attention residual add is fused into its norm."""

    def __init__(self, layer: Llama3DecoderLayer) -> None:
        super().__init__()
        self.self_attn = layer.self_attn
        self.mlp = layer.mlp
        self.input_layernorm = layer.input_layernorm
        norm = layer.post_attention_layernorm
        assert isinstance(norm, TritonRMSNorm), "swap the layer's norms first"
        self.post_attention_layernorm = norm

    def forward(
        self,
        x: torch.Tensor,  # [T, H]: the residual stream
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        backend: AttentionBackend,
        attn_metadata: Any,
    ) -> torch.Tensor:
        h = self.self_attn(self.input_layernorm(x), rope, kv_cache, backend, attn_metadata)
        normed, x = self.post_attention_layernorm.add_and_norm(h, x)  # x + h, its norm
        return x + self.mlp(normed)


def use_triton_kernels(model: nn.Module, *, rope: bool = True) -> int:
    """Swaps the Triton layers into ``model`` (a target or a drafter), sharing its weights:
    every ``RMSNorm`` and ``GatedMLP``, every ``Llama3DecoderLayer``, and, with ``rope``
    (an attention backend whose metadata carries ``positions``), the ``Llama3Attention`` of
    a module whose ``rotary`` is a plain ``RotaryEmbedding`` (llama3 scaling included).
    Returns the number of modules swapped. Imports triton."""
    from kernels.triton import elementwise as ops

    inv_freqs: dict[int, torch.Tensor] = {}
    for owner in model.modules() if rope else ():
        rotary = getattr(owner, "rotary", None)
        if type(rotary) is not RotaryEmbedding or rotary.inv_freq()[1] != 1.0:
            continue  # YaRN's cos/sin factor: not the kernel's rotation
        inv_freq = rotary.inv_freq()[0].to(rotary.cos.device)
        for sub in owner.modules():
            if isinstance(sub, Llama3Attention):
                inv_freqs[id(sub)] = inv_freq
    swapped = 0

    def swap(parent: nn.Module) -> None:
        nonlocal swapped
        for name, child in list(parent.named_children()):
            swap(child)
            new: nn.Module | None = None
            if isinstance(child, RMSNorm):
                new = TritonRMSNorm(child, ops)
            elif isinstance(child, GatedMLP):
                new = TritonGatedMLP(child, ops)
            elif isinstance(child, Llama3DecoderLayer):
                new = TritonLlama3DecoderLayer(child)
            elif isinstance(child, Llama3Attention) and id(child) in inv_freqs:
                new = TritonLlama3Attention(child, inv_freqs[id(child)], ops)
            if new is not None:
                setattr(parent, name, new)
                swapped += 1

    swap(model)
    return swapped

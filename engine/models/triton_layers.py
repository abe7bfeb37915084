"""The GPU path's layers: RMSNorm (with the residual adds fused), RoPE and SiLU-and-mul
through ``kernels.triton.elementwise``, and kept block-FP8 projections as W8A8 products
(``kernels.triton.fp8_gemm``).

``use_triton_kernels`` swaps them into a loaded model once, in place, sharing its
parameters, so the torch path keeps its own modules untouched (nothing is decided per
call). RoPE takes each token's position from the attention metadata: the Triton and
flash-attn backends' metadata carry ``positions``, the positions every caller looks the
rope tables up at (``BatchLayout.positions``). YaRN's cos/sin factor and DeepSeek-V3's
interleaved rotary dims are the kernel's arguments.

Residual adds: a decoder layer adds its attention output to the residual stream inside
its post-attention norm, and its MLP output inside the next layer's input norm (the final
norm for the last layer): ``FusedDecoder`` passes (output, residual) pairs between
layers. The sums are the ones the torch path computes, in the same dtype: fusing them
changes no bit.

Split over tensor-parallel ranks, the layers all-reduce what their torch modules do (o_proj
and down_proj's partial sums), and the decoder gathers the LM head's vocabulary shards.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

import torch
from torch import nn

from engine.attention.base import AttentionBackend
from engine.fp8 import Fp8Linear, QuantizationError
from engine.models.deepseek_v3 import DeepseekV3DecoderLayer, MultiHeadLatentAttention
from engine.models.layers import GatedMLP, RMSNorm, RotaryEmbedding
from engine.models.llama3 import (
    NO_HIDDEN_STATES,
    Llama3Attention,
    Llama3DecoderLayer,
    ModelOutputs,
    ReturnHiddenStates,
    whole_logits,
)


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


class TritonFp8Linear(nn.Module):
    """``Fp8Linear`` as W8A8 (``kernels.triton.fp8_gemm``): its tokens quantized per block
    of ``block_k`` channels, then products of FP8 blocks on the tensor cores."""

    def __init__(self, linear: Fp8Linear, ops: ModuleType) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight: torch.Tensor
        self.scale: torch.Tensor
        self.register_buffer("weight", linear.weight, persistent=False)  # shared, as a buffer
        self.register_buffer("scale", linear.scale, persistent=False)
        self.bias, self.block_k, self._ops = linear.bias, linear.block.block_k, ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self._ops.block_fp8_linear(
            x, self.weight, self.scale, self.block_k, self.bias
        )
        return out


class TritonGatedMLP(nn.Module):
    """``GatedMLP`` with silu(gate) * up in one kernel over the fused projection."""

    def __init__(self, mlp: GatedMLP, ops: ModuleType) -> None:
        super().__init__()
        self.intermediate_size = mlp.intermediate_size
        self.gate_up_proj, self.down_proj, self._ops = mlp.gate_up_proj, mlp.down_proj, ops
        self.tp = mlp.tp  # split: down_proj's partial sums are all-reduced, as mlp's are

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [..., 2I]
        act = self._ops.silu_and_mul(gate_up.reshape(-1, gate_up.shape[-1]).contiguous())
        out = self.down_proj(act.view(*gate_up.shape[:-1], self.intermediate_size))
        return out if self.tp is None else self.tp.all_reduce(out)


class TritonLlama3Attention(nn.Module):
    """``Llama3Attention`` with queries and keys rotated by the RoPE kernel."""

    def __init__(
        self, attn: Llama3Attention, inv_freq: torch.Tensor, cos_sin_factor: float, ops: ModuleType
    ) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = attn.num_heads, attn.num_kv_heads
        self.head_dim, self.q_size, self.kv_size = attn.head_dim, attn.q_size, attn.kv_size
        self.qkv_proj, self.o_proj, self._ops = attn.qkv_proj, attn.o_proj, ops
        self.tp = attn.tp  # split: o_proj's partial sums are all-reduced, as attn's are
        self.cos_sin_factor = cos_sin_factor
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
        qk = qk.view(t, -1, self.head_dim)  # queries and keys, turned together
        qk = self._ops.rope(qk, attn_metadata.positions, self.inv_freq, self.cos_sin_factor)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = v.view(t, self.num_kv_heads, self.head_dim)
        out = backend.forward(q, k, v, kv_cache[0], kv_cache[1], attn_metadata)  # [T, Hq, D]
        return self.tp.all_reduce(self.o_proj(out.reshape(t, self.q_size)))


class TritonLatentAttention(MultiHeadLatentAttention):
    """``MultiHeadLatentAttention`` whose rope parts turn in the RoPE kernel: YaRN's cos/sin
    factor applied, interleaved dims read in place (no deinterleaving copy)."""

    def __init__(
        self,
        attn: MultiHeadLatentAttention,
        inv_freq: torch.Tensor,
        cos_sin_factor: float,
        ops: ModuleType,
    ) -> None:
        nn.Module.__init__(self)  # shares attn's submodules and settings, builds none
        for name, value in vars(attn).items():
            if not name.startswith("_"):  # sizes, scale, flags, absent projections
                setattr(self, name, value)
        for name, module in attn.named_children():
            setattr(self, name, module)
        self.cos_sin_factor, self._ops = cos_sin_factor, ops
        self.inv_freq: torch.Tensor
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # [R/2] fp32

    def rotate(
        self,
        q_rope: torch.Tensor,  # [T, heads, R], rows strided
        k_rope: torch.Tensor,  # [T, 1, R]
        rope: tuple[torch.Tensor, torch.Tensor],  # unused: the kernel computes its angles
        attn_metadata: Any,  # with ``positions`` [T]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        positions, turn = attn_metadata.positions, self._ops.rope
        args = (self.inv_freq, self.cos_sin_factor, self.rope_interleave)
        return turn(q_rope, positions, *args), turn(k_rope, positions, *args)


class TritonDecoderLayer(nn.Module):
    """A Llama-3 or DeepSeek-V3 decoder layer whose residual adds happen in its norms."""

    def __init__(self, layer: Llama3DecoderLayer | DeepseekV3DecoderLayer) -> None:
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
        kv_cache: Sequence[torch.Tensor],
        backend: AttentionBackend,
        attn_metadata: Any,
    ) -> torch.Tensor:
        out, residual = self.forward_fused(x, None, rope, kv_cache, backend, attn_metadata)
        return residual + out

    def forward_fused(
        self,
        x: torch.Tensor,  # [T, H]: the last layer's output, or the embeddings
        residual: torch.Tensor | None,  # [T, H]: the stream x adds to; None for embeddings
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_cache: Sequence[torch.Tensor],
        backend: AttentionBackend,
        attn_metadata: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(MLP output, the residual stream it adds to), [T, H] each: the stream after this
        layer is their sum, which the next norm takes as it adds them."""
        if residual is None:
            normed, residual = self.input_layernorm(x), x
        else:
            assert isinstance(self.input_layernorm, TritonRMSNorm)
            normed, residual = self.input_layernorm.add_and_norm(x, residual)
        h = self.self_attn(normed, rope, kv_cache, backend, attn_metadata)
        normed, residual = self.post_attention_layernorm.add_and_norm(h, residual)  # + h
        return self.mlp(normed), residual


class FusedDecoder(nn.Module):
    """The Triton path's decoder loop, which ``engine.models.llama3.run_decoder`` hands a
    model's forward to: ``run_decoder`` with each layer's last residual add fused into the
    next layer's input norm, and the last one into the final norm."""

    def forward(
        self,
        model: Any,  # Llama3Model or DeepseekV3Model, every layer a TritonDecoderLayer
        tokens: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: Sequence[Sequence[torch.Tensor]],
        backend: AttentionBackend,
        attn_metadata: Any,
        logit_indices: torch.Tensor,  # [N] int64
        return_hidden_states: ReturnHiddenStates = NO_HIDDEN_STATES,
        on_layer: Callable[[int], None] | None = None,
    ) -> ModelOutputs:
        x = model.embed_tokens(tokens)  # [T, H]
        rope = model.rotary.lookup(positions)
        residual: torch.Tensor | None = None
        hidden: dict[int, torch.Tensor] = {}
        wanted = set(return_hidden_states.layer_ids)
        for i, layer in enumerate(model.layers):
            kv = kv_caches[i]
            x, residual = layer.forward_fused(x, residual, rope, kv, backend, attn_metadata)
            if i in wanted:  # the residual stream after layer i, summed as the torch path
                hidden[i] = residual + x
            if on_layer is not None:
                on_layer(i)
        assert residual is not None, "a decoder has layers"
        if return_hidden_states.final:
            final, _ = model.norm.add_and_norm(x, residual)
            logits = whole_logits(model, model.lm_head(final[logit_indices]).float())  # [N, V]
            return ModelOutputs(logits=logits, hidden_states=hidden, final_hidden_state=final)
        normed, _ = model.norm.add_and_norm(x[logit_indices], residual[logit_indices])
        logits = whole_logits(model, model.lm_head(normed).float())
        return ModelOutputs(logits=logits, hidden_states=hidden)


def use_triton_kernels(model: nn.Module, *, rope: bool = True) -> int:
    """Swaps the Triton layers into ``model`` (a target or a drafter), sharing its weights:
    every kept block-FP8 projection (W8A8; refused, naming it, for blocks the kernel
    cannot run), every ``RMSNorm`` and ``GatedMLP``, every Llama-3 and DeepSeek-V3 decoder
    layer, and,
    with ``rope`` (an attention backend whose metadata carries ``positions``), the
    ``Llama3Attention`` and ``MultiHeadLatentAttention`` of a module with a ``rotary``
    (llama3 and YaRN scaling included). A model run by ``run_decoder`` whose layers all
    swapped gets ``fused_decoder``. Returns the number of modules swapped. Imports triton."""
    from kernels.triton import elementwise as ops

    rotations: dict[int, tuple[torch.Tensor, float]] = {}
    for owner in model.modules() if rope else ():
        rotary = getattr(owner, "rotary", None)
        if not isinstance(rotary, RotaryEmbedding):
            continue
        inv_freq, factor = rotary.inv_freq()
        for sub in owner.modules():
            if isinstance(sub, (Llama3Attention, MultiHeadLatentAttention)) and not isinstance(
                sub, TritonLatentAttention
            ):
                rotations[id(sub)] = (inv_freq.to(rotary.cos.device), factor)
    from kernels.triton import fp8_gemm

    for path, module in model.named_modules():
        if isinstance(module, Fp8Linear) and not fp8_gemm.supports(module.block.block_k):
            raise QuantizationError(
                f"{path}.weight: blocks of {module.block.block_k} columns; the GPU's W8A8 "
                "kernel runs a power of two from 32 to 256. Use --fp8-weights dequantize"
            )
    swapped = 0

    def swap(parent: nn.Module) -> None:
        nonlocal swapped
        for name, child in list(parent.named_children()):
            swap(child)
            new: nn.Module | None = None
            if isinstance(child, Fp8Linear):
                new = TritonFp8Linear(child, fp8_gemm)
            elif isinstance(child, RMSNorm):
                new = TritonRMSNorm(child, ops)
            elif isinstance(child, GatedMLP):
                new = TritonGatedMLP(child, ops)
            elif isinstance(child, (Llama3DecoderLayer, DeepseekV3DecoderLayer)):
                new = TritonDecoderLayer(child)
            elif isinstance(child, Llama3Attention) and id(child) in rotations:
                new = TritonLlama3Attention(child, *rotations[id(child)], ops)
            elif isinstance(child, MultiHeadLatentAttention) and id(child) in rotations:
                new = TritonLatentAttention(child, *rotations[id(child)], ops)
            if new is not None:
                setattr(parent, name, new)
                swapped += 1

    swap(model)
    layers = getattr(model, "layers", None)
    if (
        isinstance(getattr(model, "norm", None), TritonRMSNorm)
        and hasattr(model, "embed_tokens")
        and layers
        and all(_is_fusable(layer) for layer in layers)
    ):
        model.fused_decoder = FusedDecoder()
    return swapped


def _is_fusable(layer: nn.Module) -> bool:
    return isinstance(layer, TritonDecoderLayer) and isinstance(
        layer.input_layernorm, TritonRMSNorm
    )

"""Llama-3 decoder over a paged KV cache, for ragged batches of prefill chunks and decode rows."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from engine.attention.base import AttentionBackend
from engine.config import Llama3Config
from engine.models.layers import GatedMLP, Linear, RMSNorm, RotaryEmbedding
from engine.parallel.group import TensorParallelGroup
from engine.parallel.layers import VocabParallelEmbedding, gather_logits

# Positions past max_seq_len that speculative decoding may write before it rolls back.
ROPE_SLACK_POSITIONS = 64


@dataclass(frozen=True)
class ReturnHiddenStates:
    """Which hidden states a forward returns besides logits (drafters need them).

    ``layer_ids``: residual stream after decoder layer i (0-based), for each i.
    ``final``: the last hidden state after the final norm (what the lm_head sees).
    """

    layer_ids: tuple[int, ...] = ()
    final: bool = False


NO_HIDDEN_STATES = ReturnHiddenStates()


@dataclass
class ModelOutputs:
    logits: torch.Tensor  # [N, V] fp32, one row per requested logit index
    hidden_states: dict[int, torch.Tensor] = field(default_factory=dict)  # layer id -> [T, H]
    final_hidden_state: torch.Tensor | None = None  # [T, H]


class Llama3Attention(nn.Module):
    def __init__(
        self,
        config: Llama3Config,
        in_features: int | None = None,
        tp: TensorParallelGroup | None = None,
    ) -> None:
        """``in_features``: width of the input when it is not ``hidden_size`` (EAGLE-3).
        ``tp``: this rank's query and KV heads only (engine.parallel.shard); o_proj's
        partial sums are all-reduced, its bias added by rank 0."""
        super().__init__()
        self.tp = tp or TensorParallelGroup.single()
        shard = self.tp.shard
        self.num_heads = len(shard.even(config.num_attention_heads, "num_attention_heads"))
        self.num_kv_heads = len(shard.kv_heads(config.num_key_value_heads))
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(
            in_features or config.hidden_size,
            self.q_size + 2 * self.kv_size,
            bias=config.attention_bias,
        )
        o_bias = config.attention_bias and shard.rank == 0
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=o_bias)

    def forward(
        self,
        x: torch.Tensor,  # [T, H]
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, signed sin: [T, 1, D] each
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        backend: AttentionBackend,
        attn_metadata: Any,
    ) -> torch.Tensor:
        t = x.shape[0]
        qk, v = self.qkv_proj(x).split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        qk = RotaryEmbedding.rotate(qk.view(t, -1, self.head_dim), *rope)  # queries and keys
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = v.view(t, self.num_kv_heads, self.head_dim)
        out = backend.forward(q, k, v, kv_cache[0], kv_cache[1], attn_metadata)  # [T, Hq, D]
        return self.tp.all_reduce(self.o_proj(out.reshape(t, self.q_size)))


class Llama3DecoderLayer(nn.Module):
    def __init__(self, config: Llama3Config, tp: TensorParallelGroup | None = None) -> None:
        super().__init__()
        self.self_attn = Llama3Attention(config, tp=tp)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.mlp_bias, tp=tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        backend: AttentionBackend,
        attn_metadata: Any,
    ) -> torch.Tensor:
        h = self.self_attn(self.input_layernorm(x), rope, kv_cache, backend, attn_metadata)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama3Model(nn.Module):
    """Embedding, decoder layers, final norm and lm_head; logits only where asked. Under
    tensor parallelism (``tp``), each holds this rank's part (engine.parallel.shard)."""

    traces_whole = True  # its forward is one graph when compiled (compile_decode_model)

    def __init__(self, config: Llama3Config, tp: TensorParallelGroup | None = None) -> None:
        super().__init__()
        self.config = config
        self.tp = tp or TensorParallelGroup.single()
        vocab, h = config.vocab_size, config.hidden_size
        self.embed_tokens: nn.Embedding | VocabParallelEmbedding = nn.Embedding(vocab, h)
        if self.tp.size > 1:
            self.embed_tokens = VocabParallelEmbedding(vocab, h, self.tp)
        self.layers = nn.ModuleList(
            Llama3DecoderLayer(config, self.tp) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = Linear(h, len(self.tp.shard.vocab(vocab)), bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = RotaryEmbedding(
            config.head_dim,
            config.max_seq_len + ROPE_SLACK_POSITIONS,
            config.rope_theta,
            config.rope_scaling,
            config.dtype,
        )

    def finalize(self) -> None:
        """Restores what materialising from the meta device loses: weight ties and buffers.
        A GGUF embedding tied to its quantized LM head reads that head's blocks itself."""
        weight = getattr(self.embed_tokens, "weight", None)  # a GgufEmbedding has none
        if self.config.tie_word_embeddings and weight is not None:
            self.lm_head.weight = weight
        self.rotary.reset_buffers(self.norm.weight.device)

    def forward(
        self,
        tokens: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer (k, v) block pools
        backend: AttentionBackend,
        attn_metadata: Any,
        logit_indices: torch.Tensor,  # [N] int64: which of the T tokens get logits
        return_hidden_states: ReturnHiddenStates = NO_HIDDEN_STATES,
        on_layer: Callable[[int], None] | None = None,  # told once layer i wrote its KV
    ) -> ModelOutputs:
        return run_decoder(
            self,
            tokens,
            positions,
            kv_caches,
            backend,
            attn_metadata,
            logit_indices,
            return_hidden_states,
            on_layer,
        )


def run_decoder(
    model: Any,  # an nn.Module with the attributes below
    tokens: torch.Tensor,
    positions: torch.Tensor,
    kv_caches: Sequence[Sequence[torch.Tensor]],
    backend: AttentionBackend,
    attn_metadata: Any,
    logit_indices: torch.Tensor,
    return_hidden_states: ReturnHiddenStates = NO_HIDDEN_STATES,
    on_layer: Callable[[int], None] | None = None,
) -> ModelOutputs:
    """A decoder's forward over ragged rows (Llama-3's and DeepSeek-V3's): ``model`` has
    ``embed_tokens``, ``rotary``, ``layers`` (each called as ``layer(x, rope, kv, backend,
    metadata)``), ``norm`` and ``lm_head``; logits only at ``logit_indices``. A model on the
    Triton path runs its ``fused_decoder`` instead (``engine.models.triton_layers``)."""
    fused_decoder = getattr(model, "fused_decoder", None)
    if fused_decoder is not None:
        return fused_decoder(
            model,
            tokens,
            positions,
            kv_caches,
            backend,
            attn_metadata,
            logit_indices,
            return_hidden_states,
            on_layer,
        )
    x = model.embed_tokens(tokens)  # [T, H]
    rope = model.rotary.lookup(positions)
    hidden: dict[int, torch.Tensor] = {}
    wanted = set(return_hidden_states.layer_ids)
    for i, layer in enumerate(model.layers):
        x = layer(x, rope, kv_caches[i], backend, attn_metadata)
        if i in wanted:
            hidden[i] = x
        if on_layer is not None:  # a prefill worker starts pushing layer i's KV
            on_layer(i)
    final = model.norm(x) if return_hidden_states.final else None
    normed = final[logit_indices] if final is not None else model.norm(x[logit_indices])
    logits = whole_logits(model, model.lm_head(normed).float())  # [N, V]
    return ModelOutputs(logits=logits, hidden_states=hidden, final_hidden_state=final)


def whole_logits(model: Any, logits: torch.Tensor) -> torch.Tensor:
    """``logits`` of every vocabulary row: split, this rank's columns gathered with the
    other ranks' (a draft: no ``tp``)."""
    tp = getattr(model, "tp", None)
    if tp is not None:
        logits = gather_logits(tp, logits, model.config.vocab_size)
    dp = getattr(model, "dp", None)  # data-parallel attention: every rank's rows, in rank order
    return logits if dp is None else dp.gather_rows(logits, dp.logits)

"""DeepSeek-V3 over a paged KV cache: multi-head latent attention (MLA) with a compressed
cache, mixture-of-experts layers after the first dense ones.

MLA caches, per token and layer, one vector shared by every head: the normalised latent
``c`` (``kv_lora_rank``) followed by the rotated key part ``k_rope`` (``qk_rope_head_dim``).
Attention runs in the absorbed form, as multi-query attention over that vector: the
up-projection of keys is folded into each head's query (``q_nope @ W_UK`` scores ``c``
as ``q_nope . (W_UK c)`` would), the values are ``c`` itself, and each head's output is
projected up by ``W_UV`` afterwards. So the backend attends one KV head of width
``kv_lora_rank + qk_rope_head_dim`` and the cache holds no per-head keys or values.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from engine.attention.base import AttentionBackend
from engine.deepseek_v3_config import DeepseekV3Config, YarnRopeScaling
from engine.models.layers import GatedMLP, Linear, RMSNorm, RotaryEmbedding
from engine.models.llama3 import (
    NO_HIDDEN_STATES,
    ROPE_SLACK_POSITIONS,
    ModelOutputs,
    ReturnHiddenStates,
    run_decoder,
    whole_logits,
)
from engine.models.moe import DataParallelStep, DeepseekV3MoE
from engine.parallel.group import TensorParallelGroup
from engine.parallel.layers import VocabParallelEmbedding


class YarnRotaryEmbedding(RotaryEmbedding):
    """RoPE tables with YaRN's frequencies and cos/sin factor (or plain RoPE without it)."""

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        yarn: YarnRopeScaling | None,
        dtype: torch.dtype,
    ) -> None:
        self.yarn = yarn
        super().__init__(head_dim, max_positions, theta, None, dtype)

    def inv_freq(self) -> tuple[torch.Tensor, float]:
        if self.yarn is None:
            return super().inv_freq()
        return self.yarn.inv_freq(self.head_dim, self.theta), self.yarn.cos_sin_factor


def yarn_rotary(config: DeepseekV3Config) -> YarnRotaryEmbedding:
    """The rope tables of ``config``'s rotary dims, its whole context and slack."""
    return YarnRotaryEmbedding(
        config.qk_rope_head_dim,
        config.max_seq_len + ROPE_SLACK_POSITIONS,
        config.rope_theta,
        config.rope_scaling,
        config.dtype,
    )


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """Rotary dims stored as pairs ``(x0, x1), (x2, x3), ...`` -> ``[x0, x2, ..., x1, x3, ...]``,
    the halves ``rotate`` pairs up (DeepSeek's checkpoints interleave them)."""
    return x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)


class MultiHeadLatentAttention(nn.Module):
    def __init__(
        self,
        config: DeepseekV3Config,
        in_features: int | None = None,
        tp: TensorParallelGroup | None = None,
    ) -> None:
        """``in_features``: width of the input when it is not ``hidden_size`` (EAGLE-3).
        ``tp``: this rank's heads only (their query, ``kv_b_proj`` and ``o_proj`` parts);
        the latent and its projection are every rank's, so each caches the whole latent.
        o_proj's partial sums are all-reduced, its bias added by rank 0."""
        super().__init__()
        c = config
        self.tp = tp or TensorParallelGroup.single()
        heads = len(self.tp.shard.even(c.num_attention_heads, "num_attention_heads"))
        self.num_heads, self.kv_lora_rank = heads, c.kv_lora_rank
        self.nope_dim, self.rope_dim, self.v_dim = (
            c.qk_nope_head_dim,
            c.qk_rope_head_dim,
            c.v_head_dim,
        )
        self.rope_interleave = c.rope_interleave
        h, q_out = c.hidden_size, heads * c.qk_head_dim
        inp = in_features or h
        self.q_proj: Linear | None = None
        self.q_a_proj: Linear | None = None
        self.q_a_layernorm: RMSNorm | None = None
        self.q_b_proj: Linear | None = None
        if c.q_lora_rank is None:
            self.q_proj = Linear(inp, q_out, bias=False)
        else:
            self.q_a_proj = Linear(inp, c.q_lora_rank, bias=c.attention_bias)
            self.q_a_layernorm = RMSNorm(c.q_lora_rank, 1e-6)
            self.q_b_proj = Linear(c.q_lora_rank, q_out, bias=False)
        self.kv_a_proj_with_mqa = Linear(
            inp, c.kv_lora_rank + c.qk_rope_head_dim, bias=c.attention_bias
        )
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, 1e-6)
        # A torch Linear, not ours: its weight is read as W_UK and W_UV, never multiplied
        # as a whole, and must survive ``release_packed_weights``.
        self.kv_b_proj = nn.Linear(
            c.kv_lora_rank, heads * (c.qk_nope_head_dim + c.v_head_dim), bias=False
        )
        o_bias = c.attention_bias and self.tp.shard.rank == 0
        self.o_proj = Linear(heads * c.v_head_dim, h, bias=o_bias)
        # The backend scales scores by 1/sqrt(its head width); the query makes up the rest.
        self.query_scale = c.softmax_scale * (c.kv_lora_rank + c.qk_rope_head_dim) ** 0.5

    def forward(
        self,
        x: torch.Tensor,  # [T, H]
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, signed sin: [T, 1, R] each
        kv_cache: Sequence[torch.Tensor],  # (pool [num_blocks, block_size, 1, L + R],)
        backend: AttentionBackend,
        attn_metadata: Any,
    ) -> torch.Tensor:
        t, heads, lat = x.shape[0], self.num_heads, self.kv_lora_rank
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            assert self.q_a_proj and self.q_a_layernorm and self.q_b_proj
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_rope = q.view(t, heads, -1).split([self.nope_dim, self.rope_dim], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([lat, self.rope_dim], dim=-1)
        q_rope, k_rope = self.rotate(q_rope, k_rope.view(t, 1, self.rope_dim), rope, attn_metadata)
        entry = torch.cat([self.kv_a_layernorm(latent).unsqueeze(1), k_rope], dim=-1)  # [T,1,L+R]

        w_kv = self.kv_b_proj.weight.view(heads, self.nope_dim + self.v_dim, lat)
        w_uk, w_uv = w_kv[:, : self.nope_dim], w_kv[:, self.nope_dim :]  # [h, n, L], [h, v, L]
        q_latent = torch.einsum("thn,hnl->thl", q_nope, w_uk)  # [T, heads, L]
        query = torch.cat([q_latent, q_rope], dim=-1) * self.query_scale  # [T, heads, L+R]
        pool = kv_cache[0]
        # Keys and values are the same cached vector; the values' rope part is dropped after.
        out = backend.forward(query, entry, entry, pool, pool, attn_metadata)  # [T, heads, L+R]
        out = torch.einsum("thl,hvl->thv", out[..., :lat], w_uv)  # [T, heads, v]
        return self.tp.all_reduce(self.o_proj(out.reshape(t, heads * self.v_dim)))

    def rotate(
        self,
        q_rope: torch.Tensor,  # [T, heads, R]
        k_rope: torch.Tensor,  # [T, 1, R]
        rope: tuple[torch.Tensor, torch.Tensor],
        attn_metadata: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotated rope parts of queries and keys, with the rope tables (the Triton
        path's ``TritonLatentAttention`` turns them in its kernel instead)."""
        if self.rope_interleave:
            q_rope, k_rope = deinterleave(q_rope), deinterleave(k_rope)
        q_rope = RotaryEmbedding.rotate(q_rope.contiguous(), *rope)  # [T, heads, R]
        k_rope = RotaryEmbedding.rotate(k_rope.contiguous(), *rope)  # [T, 1, R]
        return q_rope, k_rope


class DeepseekV3DecoderLayer(nn.Module):
    def __init__(
        self,
        config: DeepseekV3Config,
        layer_id: int,
        tp: TensorParallelGroup | None = None,
        moe_group: TensorParallelGroup | None = None,  # default: tp
        dp: DataParallelStep | None = None,
    ) -> None:
        super().__init__()
        self.self_attn = MultiHeadLatentAttention(config, tp=tp)
        self.mlp: nn.Module = (
            GatedMLP(config.hidden_size, config.intermediate_size, bias=False, tp=tp)
            if layer_id < config.first_k_dense_replace
            else DeepseekV3MoE(config, moe_group or tp, dp)
        )
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_cache: Sequence[torch.Tensor],
        backend: AttentionBackend,
        attn_metadata: Any,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, kv_cache, backend, attn_metadata)
        return x + self.mlp(self.post_attention_layernorm(x))


def eagle3_layer_ids(num_layers: int) -> tuple[int, ...]:
    """The low, middle and high layers whose residual streams an EAGLE-3 draft reads by
    default: the outputs of layers 1, L/2 - 1 and L - 4 (EAGLE-3's taps), kept in range."""
    taps = (1, num_layers // 2 - 1, num_layers - 4)
    return tuple(sorted({min(max(i, 0), num_layers - 1) for i in taps}))


def concat_hidden_states(out: ModelOutputs, layer_ids: Sequence[int]) -> torch.Tensor:
    """The residual streams of ``layer_ids`` side by side, what EAGLE-3's ``fc`` takes:
    [T, len(layer_ids) * H]. The forward must have been asked for them."""
    return torch.cat([out.hidden_states[i] for i in layer_ids], dim=-1)


class DeepseekV3Model(nn.Module):
    """Embedding, decoder layers, final norm and lm_head; logits only where asked.

    The same forward as ``Llama3Model``: one ragged batch of prompt chunks and decode rows
    over the paged cache, hidden states of the layers ``return_hidden_states`` names.
    Under tensor parallelism (``tp``), each holds this rank's part: its heads, MLP and
    expert channels (or its experts, with ``config.expert_parallel``), vocabulary rows.
    """

    def __init__(self, config: DeepseekV3Config, tp: TensorParallelGroup | None = None) -> None:
        super().__init__()
        self.config = config
        group = tp or TensorParallelGroup.single()
        # Data-parallel attention: the experts split over the whole ``group``; the rest over
        # the ranks of this rank's data-parallel rank (whole where it has one rank); the
        # rows a step gives each data-parallel rank are in ``dp`` (DataParallelStep).
        self.moe_group = self.tp = group
        self.dp: DataParallelStep | None = None
        if config.data_parallel_size > 1:
            layout = group.split_data_parallel(config.data_parallel_size)
            self.tp = layout.attention
            self.dp = DataParallelStep(layout.rows)
        vocab, h = config.vocab_size, config.hidden_size
        self.embed_tokens: nn.Embedding | VocabParallelEmbedding = nn.Embedding(vocab, h)
        if self.tp.size > 1:
            self.embed_tokens = VocabParallelEmbedding(vocab, h, self.tp)
        self.layers = nn.ModuleList(
            DeepseekV3DecoderLayer(config, i, self.tp, group, self.dp)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = Linear(h, len(self.tp.shard.vocab(vocab)), bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = yarn_rotary(config)
        self.eagle3_layer_ids = eagle3_layer_ids(config.num_hidden_layers)

    def finalize(self) -> None:
        """Restores what materialising from the meta device and casting lose: weight ties,
        buffers, and the routers' fp32."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary.reset_buffers(self.embed_tokens.weight.device)
        for layer in self.layers:
            if isinstance(layer.mlp, DeepseekV3MoE):
                layer.mlp.gate.keep_fp32()

    def idle_pass(self, hidden: ReturnHiddenStates = NO_HIDDEN_STATES) -> ModelOutputs:
        """A data-parallel rank with no rows this step: it joins the others' collectives
        (each MoE layer's gather and all-reduce, the logits' gather) with none of its own;
        the hidden states ``hidden`` asks for have no rows."""
        x = self.embed_tokens.weight.new_zeros(0, self.config.hidden_size)
        for layer in self.layers:
            if isinstance(layer.mlp, DeepseekV3MoE):
                layer.mlp(x)
        empty = x.new_zeros(0, self.config.vocab_size, dtype=torch.float32)
        return ModelOutputs(
            logits=whole_logits(self, empty),
            hidden_states={i: x for i in hidden.layer_ids},
            final_hidden_state=x if hidden.final else None,
        )

    def forward(
        self,
        tokens: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: Sequence[Sequence[torch.Tensor]],  # per layer (latent+rope pool,)
        backend: AttentionBackend,
        attn_metadata: Any,
        logit_indices: torch.Tensor,  # [N] int64: which of the T tokens get logits
        return_hidden_states: ReturnHiddenStates = NO_HIDDEN_STATES,
        on_layer: Callable[[int], None] | None = None,  # told once layer i wrote its KV
    ) -> ModelOutputs:
        if self.dp is not None and tokens.numel() == 0:
            return self.idle_pass(return_hidden_states)
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

"""DFlash (block diffusion) for Llama-3: one parallel forward drafts a whole block.

The target's hidden states at ``target_layer_ids`` are concatenated, projected by ``fc``
and normed by ``hidden_norm``; every draft layer turns them into context K/V for the
committed positions (``extend``). A block ``[next_token, MASK x (block_size-1)]``, embedded
with the target's embedding, then runs through the draft layers *non-causally* over that
context (``propose``); the target's lm_head on the draft's normed outputs at block
positions 1.. gives ``block_size - 1`` drafts at once, so K is ``block_size - 1``.
Config as the reference ``DflashDraftHFConfig``: ``mask_token_id``, ``target_layer_ids``,
``block_size``, ``num_target_layers``, at top level or under ``dflash_config``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, cast

import torch
from torch import nn

from engine.attention.base import AttentionBackend, BatchLayout
from engine.config import Llama3Config
from engine.models.layers import Linear, RMSNorm, RotaryEmbedding
from engine.models.llama3 import (
    ROPE_SLACK_POSITIONS,
    Llama3DecoderLayer,
    Llama3Model,
    ModelOutputs,
    ReturnHiddenStates,
)
from engine.parallel.layers import gather_logits
from engine.registry import decoder_layer_rules
from engine.spec.drafters.base import (
    DraftConfigError,
    DraftLogits,
    DraftSignature,
    KVLayers,
    ProposeArgs,
    SelectFn,
    draft_layout,
    draft_split,
)
from engine.spec.drafters.loading import build_draft, check_layer_ids, draft_llama_config
from engine.weights import Source, TensorRule


@dataclass(frozen=True)
class DflashDraftHFConfig:
    mask_token_id: int
    target_layer_ids: list[int]
    block_size: int | None = None
    num_target_layers: int | None = None

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> DflashDraftHFConfig:
        """Reads the DFlash fields from the top level or from ``dflash_config``; strict."""
        nested = hf.get("dflash_config")
        if nested is not None and not isinstance(nested, dict):
            raise DraftConfigError(
                f"dflash_config: expected an object, got {type(nested).__name__}"
            )
        src = {**hf, **(nested or {})}
        values: dict[str, Any] = {}
        for name in ("mask_token_id", "target_layer_ids"):
            if name not in src:
                raise DraftConfigError(
                    f"{name}: required for a DFlash draft (top level or under dflash_config)"
                )
        mask = src["mask_token_id"]
        if not isinstance(mask, int) or isinstance(mask, bool) or mask < 0:
            raise DraftConfigError(f"mask_token_id: expected a token id >= 0, got {mask!r}")
        values["mask_token_id"] = mask
        ids = src["target_layer_ids"]
        if (
            not isinstance(ids, list)
            or not ids
            or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids)
        ):
            raise DraftConfigError(
                f"target_layer_ids: expected a non-empty list of integers, got {ids!r}"
            )
        values["target_layer_ids"] = ids
        for name in ("block_size", "num_target_layers"):
            value = src.get(name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise DraftConfigError(f"{name}: expected a positive integer, got {value!r}")
            values[name] = value
        if values["block_size"] is not None and values["block_size"] < 2:
            raise DraftConfigError(
                f"block_size: must be >= 2 (one known token and at least one draft), "
                f"got {values['block_size']}"
            )
        return cls(**values)

    def validate_for(self, target: Llama3Config) -> tuple[int, ...]:
        if (
            self.num_target_layers is not None
            and self.num_target_layers != target.num_hidden_layers
        ):
            raise DraftConfigError(
                f"num_target_layers: the draft was trained on a {self.num_target_layers}-layer "
                f"target, but this target has {target.num_hidden_layers} layers"
            )
        if self.mask_token_id >= target.vocab_size:
            raise DraftConfigError(
                f"mask_token_id: {self.mask_token_id} is outside the target's vocabulary "
                f"[0, {target.vocab_size})"
            )
        return check_layer_ids("target_layer_ids", self.target_layer_ids, target.num_hidden_layers)


class DflashDrafter(nn.Module):
    kind = "dflash"
    max_num_layers: ClassVar[int | None] = None

    def __init__(
        self,
        config: Llama3Config,
        target: Llama3Model,
        layer_ids: tuple[int, ...],
        mask_token_id: int,
        block_size: int,
    ) -> None:
        super().__init__()
        h = config.hidden_size
        self.config = config
        self.layer_ids = layer_ids
        self.mask_token_id = mask_token_id
        self.block_size = block_size
        self.fixed_num_draft_tokens: int | None = block_size - 1
        self.target_hidden = ReturnHiddenStates(layer_ids=layer_ids)
        self.tp = draft_split(target)  # the layers' heads and channels, with a split target
        self.fc = Linear(len(layer_ids) * target.config.hidden_size, h, bias=False)
        self.hidden_norm = RMSNorm(h, config.rms_norm_eps)
        self.layers = nn.ModuleList(
            Llama3DecoderLayer(config, self.tp) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(
            config.head_dim,
            config.max_seq_len + ROPE_SLACK_POSITIONS,
            config.rope_theta,
            config.rope_scaling,
            config.dtype,
        )
        self._target = (target.embed_tokens, target.lm_head)  # borrowed, not registered

    def signature(self) -> DraftSignature:
        return DraftSignature(self.kind, self.block_size, self.mask_token_id, tuple(self.layer_ids))

    def features(self, out: ModelOutputs) -> torch.Tensor:
        return torch.cat([out.hidden_states[i] for i in self.layer_ids], dim=-1)  # [T, n*H]

    def extend(
        self,
        tokens: torch.Tensor,
        features: torch.Tensor,
        layout: BatchLayout,
        metadata: Any,
        kv: KVLayers,
        backend: AttentionBackend,
    ) -> None:
        """Context K/V of every given position, per draft layer (no attention is computed)."""
        ctx = self.hidden_norm(self.fc(features))  # [T, H]
        cos, sin = self.rotary.lookup(layout.positions)
        t = ctx.shape[0]
        for layer, (k_cache, v_cache) in zip(self.layers, kv, strict=True):
            attn = cast(Llama3DecoderLayer, layer).self_attn  # this rank's KV heads
            k, v = attn.qkv_proj.forward_rows(ctx, attn.q_size).split(attn.kv_size, dim=-1)
            heads = (t, attn.num_kv_heads, attn.head_dim)
            k = RotaryEmbedding.rotate(k.reshape(heads), cos, sin)
            backend.write_kv(k, v.reshape(heads), k_cache, v_cache, layout.slot_mapping)
        if self.tp.size > 1:
            # No collective above: once this returns on rank 0, every rank has written its
            # heads (a KV transfer reads the whole draft KV next; engine.executor.shared_kv).
            self.tp.all_reduce(ctx.new_zeros(1))
        return None

    def propose(
        self,
        state: torch.Tensor | None,
        args: ProposeArgs,
        k: int,
        select: SelectFn,
        kv: KVLayers,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        b, bs = args.next_tokens.shape[0], self.block_size
        block = args.next_tokens.new_full((b, bs), self.mask_token_id)
        block[:, 0] = args.next_tokens  # [B, bs]: the known token, then masks
        offsets = torch.arange(1, bs + 1, device=block.device)
        positions = args.last_positions[:, None] + offsets  # [B, bs]
        layout = draft_layout(positions, args, is_causal=False)
        metadata = backend.build_metadata(layout)
        rope = self.rotary.lookup(layout.positions)
        x = self._target[0](block.reshape(-1))  # [B*bs, H]
        for layer, kv_layer in zip(self.layers, kv, strict=True):
            x = layer(x, rope, kv_layer, backend, metadata)
        x = x.view(b, bs, -1)[:, 1 : k + 1]  # [B, k, H]: positions 1.. predict the drafts
        logits = self._target[1](self.norm(x)).float()  # [B, k, V] (split: this rank's)
        logits = gather_logits(self.tp, logits, self.config.vocab_size)
        return torch.stack([select(DraftLogits(logits[:, j]), j) for j in range(k)], dim=1)


def load_dflash(
    draft_dir: str | Path | None, hf: dict[str, Any], target: Llama3Model, device: torch.device
) -> DflashDrafter:
    tc = target.config
    fields = DflashDraftHFConfig.from_hf(hf)
    ids = fields.validate_for(tc)
    block_size = fields.block_size or 16
    config = draft_llama_config(hf, tc)
    h = config.hidden_size
    rules = [
        TensorRule("fc.weight", (Source("fc.weight", (h, len(ids) * tc.hidden_size)),)),
        TensorRule("hidden_norm.weight", (Source("hidden_norm.weight", (h,)),)),
        TensorRule("norm.weight", (Source("norm.weight", (h,)),)),
    ]
    shard = draft_split(target).shard
    for i in range(config.num_hidden_layers):
        rules += decoder_layer_rules(config, f"layers.{i}", f"layers.{i}", shard=shard)
    return build_draft(
        lambda: DflashDrafter(config, target, ids, fields.mask_token_id, block_size),
        draft_dir,
        rules,
        device,
        config.dtype,
    )

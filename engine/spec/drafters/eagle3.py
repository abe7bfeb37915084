"""EAGLE-3 for Llama-3: fused low/mid/high target features and a reduced draft vocabulary.

The target's residual streams at three layers are concatenated and projected by ``fc``
(3H -> H). One mid-layer attends over ``concat(input_layernorm(embed(t)), hidden_norm(h))``
(q/k/v in-features 2H) with ``h`` as its residual; its own ``norm`` and ``lm_head`` give
logits over ``draft_vocab_size`` tokens, mapped to target ids by ``d2t`` offsets
(target id = draft id + d2t[draft id]). Later chain steps feed the mid-layer's own output
back as ``h``, without ``fc``. Public layout: ``fc.weight``, ``midlayer.*``, ``norm.weight``,
``lm_head.weight``, ``d2t``, ``t2d``; config ``draft_vocab_size`` and optionally
``eagle_config.eagle_aux_hidden_state_layer_ids`` (the layers whose *input* is tapped).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from engine.attention.base import AttentionBackend, BatchLayout
from engine.config import Llama3Config
from engine.models.layers import GatedMLP, Linear, RMSNorm, RotaryEmbedding
from engine.models.llama3 import (
    ROPE_SLACK_POSITIONS,
    Llama3Attention,
    Llama3Model,
    ModelOutputs,
    ReturnHiddenStates,
)
from engine.parallel.group import TensorParallelGroup
from engine.parallel.layers import gather_logits
from engine.registry import decoder_layer_rules
from engine.spec.drafters.base import (
    DraftConfigError,
    DraftLogits,
    DraftSignature,
    KVLayers,
    ProposeArgs,
    SelectFn,
    draft_split,
    propose_chain,
)
from engine.spec.drafters.loading import build_draft, check_layer_ids, draft_llama_config
from engine.weights import CheckpointReader, Source, TensorRule, WeightError, run_part


def default_eagle3_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's taps: the inputs of layers 2, L/2 and L-3, i.e. outputs of 1, L/2-1, L-4."""
    taps = (1, num_layers // 2 - 1, num_layers - 4)
    return tuple(sorted({min(max(i, 0), num_layers - 1) for i in taps}))


class Eagle3MidLayer(nn.Module):
    def __init__(self, config: Llama3Config, tp: TensorParallelGroup | None = None) -> None:
        super().__init__()
        h = config.hidden_size
        self.self_attn = Llama3Attention(config, in_features=2 * h, tp=tp)
        self.mlp = GatedMLP(h, config.intermediate_size, config.mlp_bias, tp=tp)
        self.input_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, config.rms_norm_eps)

    def forward(
        self,
        embed: torch.Tensor,
        hidden: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv: tuple[torch.Tensor, torch.Tensor],
        backend: AttentionBackend,
        metadata: Any,
    ) -> torch.Tensor:
        x = torch.cat([self.input_layernorm(embed), self.hidden_norm(hidden)], dim=-1)  # [T, 2H]
        h = hidden + self.self_attn(x, rope, kv, backend, metadata)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Drafter(nn.Module):
    kind = "eagle3"
    max_num_layers: ClassVar[int | None] = 1
    fixed_num_draft_tokens: int | None = None

    def __init__(
        self,
        config: Llama3Config,
        target: Llama3Model,
        layer_ids: tuple[int, ...],
        draft_vocab_size: int,
    ) -> None:
        super().__init__()
        h = config.hidden_size
        self.config = config
        self.layer_ids = layer_ids
        self.target_hidden = ReturnHiddenStates(layer_ids=layer_ids)
        # Split with a split target: the layer's heads and channels, the LM head's rows.
        self.tp = draft_split(target)
        self.fc = Linear(len(layer_ids) * h, h, bias=False)  # whole on every rank
        self.midlayer = Eagle3MidLayer(config, self.tp)
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.lm_head = Linear(h, len(self.tp.shard.vocab(draft_vocab_size)), bias=False)
        self.d2t: torch.Tensor
        self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.int64))
        self.rotary = RotaryEmbedding(
            config.head_dim,
            config.max_seq_len + ROPE_SLACK_POSITIONS,
            config.rope_theta,
            config.rope_scaling,
            config.dtype,
        )
        self.vocab_size = target.config.vocab_size
        self._embed = (target.embed_tokens,)  # borrowed, not registered

    def signature(self) -> DraftSignature:
        return DraftSignature(self.kind, target_layer_ids=tuple(self.layer_ids))

    def features(self, out: ModelOutputs) -> torch.Tensor:
        return torch.cat([out.hidden_states[i] for i in self.layer_ids], dim=-1)  # [T, 3H]

    def extra_tensors(self) -> dict[str, torch.Tensor]:
        """``d2t`` offsets and the ``t2d`` membership mask, as public checkpoints carry them."""
        ids = torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t
        t2d = torch.zeros(self.vocab_size, dtype=torch.bool, device=self.d2t.device)
        return {"d2t": self.d2t.clone(), "t2d": t2d.index_fill(0, ids, True)}

    def logits(self, hidden: torch.Tensor) -> DraftLogits:
        """Scores over the draft vocabulary, which ``d2t`` maps to target ids."""
        draft = self.lm_head(self.norm(hidden)).float()  # [B, Vd] (split: this rank's rows)
        draft = gather_logits(self.tp, draft, self.d2t.numel())
        ids = torch.arange(draft.shape[-1], device=draft.device) + self.d2t  # target ids
        return DraftLogits(draft, ids, self.vocab_size)

    def _forward(
        self,
        tokens: torch.Tensor,
        hidden: torch.Tensor,
        layout: BatchLayout,
        metadata: Any,
        kv: KVLayers,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        rope = self.rotary.lookup(layout.positions)
        return self.midlayer(self._embed[0](tokens), hidden, rope, kv[0], backend, metadata)

    def extend(
        self,
        tokens: torch.Tensor,
        features: torch.Tensor,
        layout: BatchLayout,
        metadata: Any,
        kv: KVLayers,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        return self._forward(tokens, self.fc(features), layout, metadata, kv, backend)

    def propose(
        self,
        state: torch.Tensor | None,
        args: ProposeArgs,
        k: int,
        select: SelectFn,
        kv: KVLayers,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        assert state is not None
        return propose_chain(
            state[args.last_index],
            args,
            k,
            select,
            logits=self.logits,
            step=lambda tokens, g, layout, md: self._forward(tokens, g, layout, md, kv, backend),
            backend=backend,
        )


def eagle3_layer_ids(hf: dict[str, Any], num_target_layers: int) -> tuple[int, ...]:
    """Tapped layers as "residual stream after layer i"; the public config names the layers
    whose input is tapped, so each id there is one more than ours."""
    eagle = hf.get("eagle_config") or {}
    taps = eagle.get("eagle_aux_hidden_state_layer_ids")
    if taps is None:
        return default_eagle3_layers(num_target_layers)
    name = "eagle_config.eagle_aux_hidden_state_layer_ids"
    if not isinstance(taps, list) or not all(isinstance(i, int) and i >= 1 for i in taps):
        raise DraftConfigError(f"{name}: expected layer indices >= 1, got {taps!r}")
    return check_layer_ids(name, [i - 1 for i in taps], num_target_layers)


def load_eagle3(
    draft_dir: str | Path | None,
    hf: dict[str, Any],
    target: Llama3Model,
    device: torch.device,
    layer_ids: tuple[int, ...] | None = None,
    drafter_class: type[Eagle3Drafter] | None = None,  # default: Eagle3Drafter
) -> Eagle3Drafter:
    tc = target.config
    make = drafter_class or Eagle3Drafter
    config = draft_llama_config(hf, tc)
    ids = (
        check_layer_ids("target_layer_ids", list(layer_ids), tc.num_hidden_layers)
        if layer_ids is not None
        else eagle3_layer_ids(hf, tc.num_hidden_layers)
    )
    draft_vocab = hf.get("draft_vocab_size", tc.vocab_size)
    if not isinstance(draft_vocab, int) or not 0 < draft_vocab <= tc.vocab_size:
        raise DraftConfigError(
            f"draft_vocab_size: {draft_vocab!r} must be an integer in 1..{tc.vocab_size} "
            "(the target's vocabulary)"
        )
    h = config.hidden_size
    shard = draft_split(target).shard
    head = run_part(0, shard.vocab(draft_vocab)) if shard.size > 1 else None
    rules = [
        TensorRule("fc.weight", (Source("fc.weight", (h, len(ids) * h)),)),
        TensorRule("norm.weight", (Source("norm.weight", (h,)),)),
        TensorRule("lm_head.weight", (Source("lm_head.weight", (draft_vocab, h), head),)),
        *decoder_layer_rules(
            config,
            _layer_prefix(draft_dir),
            "midlayer",
            in_features=2 * h,
            norms=("input_layernorm", "hidden_norm", "post_attention_layernorm"),
            shard=shard,
        ),
    ]

    def load_d2t(module: Eagle3Drafter, reader: CheckpointReader) -> None:
        if "d2t" not in reader.names():
            if draft_vocab != tc.vocab_size:
                raise WeightError("d2t: required when draft_vocab_size is below the target's")
            return
        d2t = reader.get("d2t").to(torch.int64)
        if tuple(d2t.shape) != (draft_vocab,):
            raise WeightError(f"d2t: shape {list(d2t.shape)} does not match [{draft_vocab}]")
        target_ids = torch.arange(draft_vocab) + d2t
        if target_ids.min() < 0 or target_ids.max() >= tc.vocab_size:
            raise WeightError("d2t: maps a draft token outside the target's vocabulary")
        module.d2t.copy_(d2t)

    return build_draft(
        lambda: make(config, target, ids, draft_vocab),
        draft_dir,
        rules,
        device,
        config.dtype,
        load_d2t,
    )


def _layer_prefix(draft_dir: str | Path | None) -> str:
    """Where the checkpoint keeps the draft's layer: ``midlayer`` (EAGLE-3's own release),
    or ``layers.0`` (e.g. nvidia's drafts for DeepSeek-V3-architecture targets)."""
    if draft_dir is None:
        return "midlayer"
    reader = CheckpointReader(draft_dir)
    try:
        names = reader.names()
    finally:
        reader.close()
    return "layers.0" if "layers.0.self_attn.q_proj.weight" in names else "midlayer"

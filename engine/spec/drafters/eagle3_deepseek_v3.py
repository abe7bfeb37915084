"""EAGLE-3 drafts for a DeepSeek-V3 target (the seed's ``eagle3_deepseekV3``): checkpoints.

Public EAGLE-3 checkpoints for DeepSeek-V3-architecture targets (nvidia's for Kimi-K2.5,
say) are laid out as ``fc.*``, ``layers.0.*``, ``norm.*`` and ``lm_head.*``, plus ``d2t``
and ``t2d`` where the draft's vocabulary is reduced. ``norm`` and ``lm_head`` are the
draft's own; ``embed_tokens`` is the target's, shared (a copy in the checkpoint is not
read). The one layer attends over ``concat(embed, hidden)`` (2H wide) with either
multi-head attention (``q_proj``/``k_proj``/``v_proj``: the MHA draft, with its own paged
K/V) or MLA (``kv_a_proj_with_mqa``...: the MLA draft, in the target's cache layout).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from engine.attention.base import AttentionBackend, BatchLayout
from engine.config import ConfigError, Llama3Config
from engine.deepseek_v3_config import DeepseekV3Config
from engine.deepseek_v3_weights import mla_attention_rules
from engine.models.deepseek_v3 import (
    DeepseekV3Model,
    MultiHeadLatentAttention,
    YarnRotaryEmbedding,
)
from engine.models.layers import GatedMLP, Linear, RMSNorm
from engine.models.llama3 import ROPE_SLACK_POSITIONS, ReturnHiddenStates
from engine.parallel.group import TensorParallelGroup
from engine.registry import decoder_layer_rules
from engine.spec.drafters.base import (
    DraftConfigError,
    KVLayers,
    ProposeArgs,
    SelectFn,
    propose_chain,
)
from engine.spec.drafters.eagle3 import (
    Eagle3Drafter,
    Eagle3MidLayer,
    eagle3_layer_ids,
    load_eagle3,
)
from engine.spec.drafters.eagle3_deepseek_v3_inputs import (
    Eagle3DeepseekV3Inputs,
    Eagle3MHADeepseekV3Inputs,
    KVCacheInputs,
)
from engine.spec.drafters.loading import build_draft, check_layer_ids
from engine.weights import CheckpointReader, Source, TensorRule, WeightError

EAGLE3_PREFIXES = ("fc.", "layers.0.", "norm.", "lm_head.")
EXTRA_TENSORS = ("d2t", "t2d")  # d2t is kept (draft id -> target id offsets); t2d derives
SHARED_FROM_TARGET = ("embed_tokens.weight", "model.embed_tokens.weight")
MIDLAYER_NORMS = ("input_layernorm", "hidden_norm", "post_attention_layernorm")


def is_mla_draft(state_dict: Mapping[str, Any]) -> bool:
    """Whether a checkpoint's layer attends with MLA (else multi-head attention)."""
    return "layers.0.self_attn.kv_a_proj_with_mqa.weight" in state_dict


def convert_eagle3_draft_state_dict(
    state_dict: Mapping[str, torch.Tensor], huggingface_config: Mapping[str, Any]
) -> dict[str, torch.Tensor]:
    """An EAGLE-3 draft checkpoint (``fc.*``, ``layers.0.*``, ``norm.*``, ``lm_head.*``) ->
    the draft module's parameters: ``fc``, ``midlayer.*`` (q/k/v and gate/up fused for the
    MHA draft; MLA's projections as they are), ``norm``, ``lm_head`` and ``d2t``.

    Shapes come from ``huggingface_config`` (the draft's config.json). A missing tensor, a
    shape that does not fit, or a tensor no draft has is refused, naming the tensor.
    """
    hf = dict(huggingface_config)
    rules = draft_rules(hf, is_mla=is_mla_draft(state_dict))
    converted: dict[str, torch.Tensor] = {}
    read: set[str] = set()
    for rule in rules:
        parts = []
        for src in rule.sources:
            if src.name not in state_dict:
                raise WeightError(f"{src.name}: missing from the EAGLE-3 checkpoint")
            tensor = state_dict[src.name]
            if tuple(tensor.shape) != src.shape:
                raise WeightError(
                    f"{src.name}: shape {list(tensor.shape)} does not match the config's "
                    f"{list(src.shape)}"
                )
            parts.append(tensor)
            read.add(src.name)
        converted[rule.dst] = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
    draft_vocab = rules_draft_vocab(hf)
    vocab = hf.get("vocab_size", draft_vocab)
    if "d2t" in state_dict or draft_vocab != vocab:
        converted["d2t"] = checked_d2t(state_dict.get("d2t"), draft_vocab, vocab)
    for name in state_dict:
        if name in read or name in EXTRA_TENSORS or name in SHARED_FROM_TARGET:
            continue
        if name.startswith(EAGLE3_PREFIXES):
            raise WeightError(f"{name}: not a tensor this draft has")
        if name.startswith("layers."):
            raise WeightError(f"{name}: an EAGLE-3 draft has one layer (layers.0.*)")
        prefixes = ", ".join(p + "*" for p in EAGLE3_PREFIXES)
        raise WeightError(f"{name}: not part of an EAGLE-3 draft ({prefixes})")
    return converted


def rules_draft_vocab(hf: Mapping[str, Any]) -> int:
    vocab = hf.get("draft_vocab_size", hf.get("vocab_size"))
    if not isinstance(vocab, int) or vocab <= 0:
        raise DraftConfigError(f"draft_vocab_size: expected a positive integer, got {vocab!r}")
    return vocab


def draft_rules(hf: dict[str, Any], *, is_mla: bool) -> list[TensorRule]:
    """How the checkpoint's tensors map onto the draft module, shapes from its config."""
    taps = (hf.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or [0, 0, 0]
    hf.setdefault("max_position_embeddings", 1 << 16)
    if not is_mla:  # shapes only: the MHA layer's RoPE does not change a tensor
        for key in ("rope_scaling", "rope_parameters"):
            hf.pop(key, None)
    try:
        if is_mla:
            mla = DeepseekV3Config.from_hf(hf, dtype="float32")
            h, inter = mla.hidden_size, mla.intermediate_size
            layer = mla_attention_rules(mla, "layers.0.self_attn", "midlayer.self_attn", 2 * h)
            layer += [
                TensorRule(
                    "midlayer.mlp.gate_up_proj.weight",
                    (
                        Source("layers.0.mlp.gate_proj.weight", (inter, h)),
                        Source("layers.0.mlp.up_proj.weight", (inter, h)),
                    ),
                ),
                TensorRule(
                    "midlayer.mlp.down_proj.weight",
                    (Source("layers.0.mlp.down_proj.weight", (h, inter)),),
                ),
            ]
            layer += [
                TensorRule(f"midlayer.{n}.weight", (Source(f"layers.0.{n}.weight", (h,)),))
                for n in MIDLAYER_NORMS
            ]
        else:
            llama = Llama3Config.from_hf(hf, dtype="float32")
            h = llama.hidden_size
            layer = decoder_layer_rules(
                llama, "layers.0", "midlayer", in_features=2 * h, norms=MIDLAYER_NORMS
            )
    except ConfigError as e:
        raise DraftConfigError(f"draft config: {e}") from e
    return [
        TensorRule("fc.weight", (Source("fc.weight", (h, len(taps) * h)),)),
        *layer,
        TensorRule("norm.weight", (Source("norm.weight", (h,)),)),
        TensorRule("lm_head.weight", (Source("lm_head.weight", (rules_draft_vocab(hf), h)),)),
    ]


class Eagle3MLAMidLayer(nn.Module):
    """EAGLE-3's one layer with MLA over ``concat(input_layernorm(embed), hidden_norm(h))``
    (2H wide) and ``h`` as its residual: its cache has the target's MLA layout."""

    def __init__(self, config: DeepseekV3Config) -> None:
        super().__init__()
        h = config.hidden_size
        self.self_attn = MultiHeadLatentAttention(config, in_features=2 * h)
        self.mlp = GatedMLP(h, config.intermediate_size, bias=False)
        self.input_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, config.rms_norm_eps)

    forward = Eagle3MidLayer.forward  # the same wiring; only the attention differs


class DeepseekV3Eagle3Dispatch(Eagle3Drafter):
    """EAGLE-3 beside a DeepSeek-V3 target: each step's forwards go through the seed's
    inputs (``inputs_class``), built at the extend and dispatched by its width."""

    inputs_class: type[Eagle3DeepseekV3Inputs] = Eagle3DeepseekV3Inputs
    step_inputs: Eagle3DeepseekV3Inputs | None = None  # the step under way's, from extend

    def extend(
        self,
        tokens: torch.Tensor,
        features: torch.Tensor,
        layout: BatchLayout,
        metadata: Any,
        kv: KVLayers,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        inputs = self.inputs_class.for_extend(tokens, features, layout, metadata, kv)
        self.step_inputs = inputs
        dispatched = self._cache_inputs().dispatch(layout, backend)
        return self._forward(tokens, self.fc(features), layout, dispatched, kv, backend)

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
        cache = self._cache_inputs()
        return propose_chain(
            state[args.last_index],
            args,
            k,
            select,
            logits=self.logits,
            step=lambda tokens, g, layout, md: self._forward(tokens, g, layout, md, kv, backend),
            backend=backend,
            build_metadata=lambda layout: cache.dispatch(layout, backend),
        )

    def _cache_inputs(self) -> KVCacheInputs:
        if self.step_inputs is None or self.step_inputs.kv_cache_inputs is None:
            raise RuntimeError("draft: propose before any extend has no step inputs")
        return self.step_inputs.kv_cache_inputs


class Eagle3MHADeepseekV3(DeepseekV3Eagle3Dispatch):
    """The MHA EAGLE-3 draft of a DeepSeek-V3 target: a Llama layer over ``concat(embed,
    hidden)``, its own paged K and V beside the target's latent pools (one block id for
    both), dispatched through ``Eagle3MHADeepseekV3Inputs`` at widths 1+K and 1."""

    inputs_class = Eagle3MHADeepseekV3Inputs


class Eagle3DeepseekV3(DeepseekV3Eagle3Dispatch):
    """The MLA EAGLE-3 draft of a DeepSeek-V3 target (the seed's name): fused low, middle
    and high target features, one MLA layer, its own norm and lm_head over a possibly
    reduced vocabulary; the target's embedding is borrowed. Proposing and verifying are
    EAGLE-3's; only the layer and its RoPE (YaRN, the draft config's) differ."""

    config: DeepseekV3Config  # type: ignore[assignment]

    def __init__(
        self,
        config: DeepseekV3Config,
        target: DeepseekV3Model,  # or a split target's WholeVocabulary (config, embed_tokens)
        layer_ids: tuple[int, ...],
        draft_vocab_size: int,
    ) -> None:
        nn.Module.__init__(self)
        h = config.hidden_size
        self.config = config
        self.layer_ids = layer_ids
        self.target_hidden = ReturnHiddenStates(layer_ids=layer_ids)
        self.tp = TensorParallelGroup.single()  # on rank 0 alone (draft_split)
        self.fc = Linear(len(layer_ids) * h, h, bias=False)
        self.midlayer = Eagle3MLAMidLayer(config)  # type: ignore[assignment]
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.lm_head = Linear(h, draft_vocab_size, bias=False)
        self.d2t: torch.Tensor
        self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.int64))
        self.rotary = YarnRotaryEmbedding(
            config.qk_rope_head_dim,
            config.max_seq_len + ROPE_SLACK_POSITIONS,
            config.rope_theta,
            config.rope_scaling,
            config.dtype,
        )
        self.vocab_size = target.config.vocab_size
        self._embed = (target.embed_tokens,)


def load_eagle3_mla(
    draft_dir: str | Path | None,
    hf: dict[str, Any],
    target: nn.Module,
    device: torch.device,
    layer_ids: tuple[int, ...] | None = None,
) -> Eagle3DeepseekV3:
    """An MLA EAGLE-3 draft (its config has ``kv_lora_rank``) for a DeepSeek-V3 target, from
    its public layout (``layers.0.*``; None: random)."""
    tc = getattr(target, "config", None)  # a split target's: its WholeVocabulary's
    if not isinstance(tc, DeepseekV3Config):
        raise DraftConfigError("kv_lora_rank: an MLA EAGLE-3 draft needs a DeepSeek-V3 target")
    shaped = {**hf, "max_position_embeddings": tc.max_seq_len}
    shaped.setdefault("vocab_size", tc.vocab_size)
    try:
        config = DeepseekV3Config.from_hf(shaped, dtype=tc.dtype)
    except ConfigError as e:
        raise DraftConfigError(f"draft config: {e}") from e
    for name in ("hidden_size", "vocab_size"):
        if getattr(config, name) != getattr(tc, name):
            raise DraftConfigError(
                f"{name}: the draft has {getattr(config, name)} but the target has "
                f"{getattr(tc, name)}; a draft shares its target's embedding"
            )
    ids = (
        check_layer_ids("target_layer_ids", list(layer_ids), tc.num_hidden_layers)
        if layer_ids is not None
        else eagle3_layer_ids(hf, tc.num_hidden_layers)
    )
    draft_vocab = rules_draft_vocab({**hf, "vocab_size": tc.vocab_size})
    rules = draft_rules(
        {**shaped, "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids}}, is_mla=True
    )

    def load_d2t(module: Eagle3DeepseekV3, reader: CheckpointReader) -> None:
        d2t = reader.get("d2t") if "d2t" in reader.names() else None
        if d2t is not None or draft_vocab != tc.vocab_size:
            module.d2t.copy_(checked_d2t(d2t, draft_vocab, tc.vocab_size))

    return build_draft(
        lambda: Eagle3DeepseekV3(config, cast(DeepseekV3Model, target), ids, draft_vocab),
        draft_dir,
        rules,
        device,
        config.dtype,
        load_d2t,
    )


def checked_d2t(d2t: torch.Tensor | None, draft_vocab: int, vocab: int) -> torch.Tensor:
    """A checkpoint's ``d2t``, checked: integers, one per draft id, mapping into the target."""
    if d2t is None:
        raise WeightError("d2t: required when draft_vocab_size is below the target's")
    if tuple(d2t.shape) != (draft_vocab,) or d2t.is_floating_point():
        raise WeightError(f"d2t: {d2t.dtype} {list(d2t.shape)}, expected integers [{draft_vocab}]")
    target_ids = torch.arange(draft_vocab) + d2t.to(torch.int64)
    if target_ids.min() < 0 or target_ids.max() >= vocab:
        raise WeightError("d2t: maps a draft token outside the target's vocabulary")
    return d2t.to(torch.int64)


def is_deepseek_v3(target: nn.Module) -> bool:
    """A DeepSeek-V3 target, or what a draft borrows of a split one (``WholeVocabulary``)."""
    return isinstance(getattr(target, "config", None), DeepseekV3Config)


def load_any_eagle3(
    draft_dir: str | Path | None,
    hf: dict[str, Any],
    target: nn.Module,
    device: torch.device,
    layer_ids: tuple[int, ...] | None = None,
) -> Eagle3Drafter:
    """EAGLE-3 of either layer: MLA where the draft's config has ``kv_lora_rank`` (a
    DeepSeek-V3 target's draft, in its cache layout), else multi-head attention."""
    if hf.get("kv_lora_rank"):
        return load_eagle3_mla(draft_dir, hf, target, device, layer_ids)
    mha = Eagle3MHADeepseekV3 if is_deepseek_v3(target) else None
    return load_eagle3(draft_dir, hf, target, device, layer_ids, mha)  # type: ignore[arg-type]

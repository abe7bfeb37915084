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
from typing import Any

import torch

from engine.config import ConfigError, Llama3Config
from engine.deepseek_v3_config import DeepseekV3Config
from engine.registry import decoder_layer_rules, mla_attention_rules
from engine.spec.drafters.base import DraftConfigError
from engine.weights import Source, TensorRule, WeightError

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
    if "d2t" in state_dict:
        d2t = state_dict["d2t"]
        if tuple(d2t.shape) != (draft_vocab,) or d2t.is_floating_point():
            raise WeightError(
                f"d2t: {d2t.dtype} {list(d2t.shape)}, expected integers [{draft_vocab}]"
            )
        converted["d2t"] = d2t.to(torch.int64)
    elif draft_vocab != hf.get("vocab_size", draft_vocab):
        raise WeightError("d2t: required when draft_vocab_size is below the target's")
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

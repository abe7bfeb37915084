"""Architectures Tandem serves, declared once each: HF name -> config, model, weight adapter."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from engine.config import ConfigError, Llama3Config, read_hf_config
from engine.weights import CheckpointReader, Source, TensorRule, load_weights


@dataclass(frozen=True)
class Architecture:
    name: str  # the HF ``architectures`` entry
    config_from_hf: Callable[..., Llama3Config]
    model_class: Callable[[Llama3Config], nn.Module]
    weight_rules: Callable[[Llama3Config], list[TensorRule]]  # the weight adapter


def _one(dst: str, src: str, shape: tuple[int, ...]) -> TensorRule:
    return TensorRule(dst, (Source(src, shape),))


def decoder_layer_rules(
    config: Llama3Config,
    hf: str,
    ours: str,
    *,
    in_features: int | None = None,
    norms: tuple[str, ...] = ("input_layernorm", "post_attention_layernorm"),
) -> list[TensorRule]:
    """One HF Llama decoder layer (prefix ``hf``) -> Tandem's fused layer (prefix ``ours``).

    ``in_features``: attention input width when it is not ``hidden_size`` (EAGLE-3);
    ``norms``: the layer's RMSNorm weights (EAGLE-1 drafts have no input_layernorm).
    """
    h, q, kv, inter = config.hidden_size, config.q_size, config.kv_size, config.intermediate_size
    inp = in_features or h
    attn, mlp = f"{hf}.self_attn", f"{hf}.mlp"
    rules = [
        TensorRule(
            f"{ours}.self_attn.qkv_proj.weight",
            (
                Source(f"{attn}.q_proj.weight", (q, inp)),
                Source(f"{attn}.k_proj.weight", (kv, inp)),
                Source(f"{attn}.v_proj.weight", (kv, inp)),
            ),
        ),
        _one(f"{ours}.self_attn.o_proj.weight", f"{attn}.o_proj.weight", (h, q)),
        TensorRule(
            f"{ours}.mlp.gate_up_proj.weight",
            (
                Source(f"{mlp}.gate_proj.weight", (inter, h)),
                Source(f"{mlp}.up_proj.weight", (inter, h)),
            ),
        ),
        _one(f"{ours}.mlp.down_proj.weight", f"{mlp}.down_proj.weight", (h, inter)),
    ]
    if config.attention_bias:
        rules.append(
            TensorRule(
                f"{ours}.self_attn.qkv_proj.bias",
                (
                    Source(f"{attn}.q_proj.bias", (q,)),
                    Source(f"{attn}.k_proj.bias", (kv,)),
                    Source(f"{attn}.v_proj.bias", (kv,)),
                ),
            )
        )
        rules.append(_one(f"{ours}.self_attn.o_proj.bias", f"{attn}.o_proj.bias", (h,)))
    if config.mlp_bias:
        rules.append(
            TensorRule(
                f"{ours}.mlp.gate_up_proj.bias",
                (
                    Source(f"{mlp}.gate_proj.bias", (inter,)),
                    Source(f"{mlp}.up_proj.bias", (inter,)),
                ),
            )
        )
        rules.append(_one(f"{ours}.mlp.down_proj.bias", f"{mlp}.down_proj.bias", (h,)))
    rules.extend(_one(f"{ours}.{norm}.weight", f"{hf}.{norm}.weight", (h,)) for norm in norms)
    return rules


def llama_weight_rules(config: Llama3Config) -> list[TensorRule]:
    """HF Llama tensors -> Tandem's fused qkv and gate_up parameters."""
    h = config.hidden_size
    rules = [_one("embed_tokens.weight", "model.embed_tokens.weight", (config.vocab_size, h))]
    for i in range(config.num_hidden_layers):
        rules.extend(decoder_layer_rules(config, f"model.layers.{i}", f"layers.{i}"))
    rules.append(_one("norm.weight", "model.norm.weight", (h,)))
    if not config.tie_word_embeddings:
        rules.append(_one("lm_head.weight", "lm_head.weight", (config.vocab_size, h)))
    return rules


def _llama_model(config: Llama3Config) -> nn.Module:
    from engine.models.llama3 import Llama3Model

    return Llama3Model(config)


ARCHITECTURES: dict[str, Architecture] = {
    "LlamaForCausalLM": Architecture(
        name="LlamaForCausalLM",
        config_from_hf=Llama3Config.from_hf,
        model_class=_llama_model,
        weight_rules=llama_weight_rules,
    ),
}


def get_architecture(hf_config: dict[str, Any]) -> Architecture:
    names = hf_config.get("architectures") or []
    for name in names:
        if name in ARCHITECTURES:
            return ARCHITECTURES[name]
    raise ConfigError(f"architectures: {names} is not supported; allowed: {sorted(ARCHITECTURES)}")


def load_model(
    model_dir: str | Path,
    *,
    dtype: str | torch.dtype = "bfloat16",
    max_length: int | None = None,
    device: str | torch.device = "cpu",
) -> tuple[nn.Module, Llama3Config]:
    """Reads config.json, builds the declared model and fills it from safetensors."""
    hf = read_hf_config(model_dir)
    arch = get_architecture(hf)
    config = arch.config_from_hf(hf, dtype=dtype, max_length=max_length)
    with torch.device("meta"):
        model = arch.model_class(config)
    model = model.to_empty(device=device).to(config.dtype)
    model.finalize()  # type: ignore[operator]  # re-tie shared weights and recompute buffers lost on the meta device
    reader = CheckpointReader(model_dir)
    try:
        load_weights(model, reader, arch.weight_rules(config))
    finally:
        reader.close()
    return model.eval(), config

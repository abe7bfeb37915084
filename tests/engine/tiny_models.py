"""Tiny random Llama checkpoints built on the fly from transformers configs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}

# name -> LlamaConfig kwargs; together they cover GQA ratios 1, 3 and 4, llama3 rope
# scaling on and off, tied and untied embeddings, biases on and off, and head dims that
# are neither hidden/heads nor a power of two.
SHAPES: dict[str, dict[str, Any]] = {
    "mha_plain": dict(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=4, intermediate_size=96
    ),
    "gqa3_llama3rope_tied_bias_hd40": dict(
        hidden_size=96,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=40,
        intermediate_size=80,
        tie_word_embeddings=True,
        attention_bias=True,
        rope_scaling=LLAMA3_ROPE,
    ),
    "gqa4_llama3rope_hd72_mlpbias": dict(
        hidden_size=96,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=72,
        intermediate_size=128,
        mlp_bias=True,
        rope_scaling=LLAMA3_ROPE,
        rope_theta=500000.0,
    ),
}


def build_tiny_llama(
    out: Path,
    shape: str,
    *,
    vocab_size: int = 320,
    num_layers: int = 3,
    seed: int = 0,
    legacy_keys: bool = False,
    max_shard_size: str | None = None,
    max_position_embeddings: int = 256,
) -> LlamaForCausalLM:
    """Saves a random model to ``out``; returns it in fp32 eval mode.

    ``legacy_keys`` rewrites config.json with transformers 4 names (rope_theta,
    rope_scaling, torch_dtype) instead of transformers 5's rope_parameters and dtype.
    """
    kwargs = dict(SHAPES[shape])
    rope_scaling = kwargs.pop("rope_scaling", None)
    rope_theta = kwargs.pop("rope_theta", 10000.0)
    rope = {"rope_type": "default", "rope_theta": rope_theta}
    if rope_scaling:
        rope = {**rope_scaling, "rope_theta": rope_theta}
    config = LlamaConfig(
        vocab_size=vocab_size,
        num_hidden_layers=num_layers,
        max_position_embeddings=max_position_embeddings,
        rope_parameters=rope,
        bos_token_id=1,
        eos_token_id=2,
        **kwargs,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # larger weights than the default init, so logits are not flat
        for p in model.parameters():
            p.normal_(0, 0.08)
    save_kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out, **save_kwargs)
    if legacy_keys:
        path = out / "config.json"
        data = json.loads(path.read_text())
        params = data.pop("rope_parameters")
        data["rope_theta"] = params.pop("rope_theta")
        if params.get("rope_type") != "default":
            data["rope_scaling"] = params
        data["torch_dtype"] = data.pop("dtype")
        path.write_text(json.dumps(data))
    return model

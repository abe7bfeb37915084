"""Tiny random DeepSeek-V3 checkpoints built on the fly from transformers configs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 64,
    "beta_fast": 32,
    "beta_slow": 1,
}

# name -> DeepseekV3Config kwargs; together they cover q-LoRA on and off, YaRN with and
# without mscales and plain RoPE, interleaved and split rotary dims, 0-2 dense layers,
# 0-2 shared experts, 2-8 expert groups, normalised and raw top-k weights, tied
# embeddings and attention biases; the first has a cached vector of 64 (the CPU paged
# attention kernel's width), the others not.
SHAPES: dict[str, dict[str, Any]] = {
    "qlora_yarn_mscale_interleaved": dict(
        hidden_size=64,
        num_attention_heads=4,
        q_lora_rank=32,
        kv_lora_rank=48,
        qk_rope_head_dim=16,
        qk_nope_head_dim=24,
        v_head_dim=20,
        intermediate_size=96,
        moe_intermediate_size=24,
        n_routed_experts=8,
        n_group=4,
        topk_group=2,
        num_experts_per_tok=2,
        n_shared_experts=1,
        first_k_dense_replace=1,
        rope_parameters={**YARN, "mscale": 1.0, "mscale_all_dim": 0.8},
    ),
    "q_proj_plain_rope_split_tied_bias": dict(
        hidden_size=48,
        num_attention_heads=3,
        q_lora_rank=None,
        kv_lora_rank=20,
        qk_rope_head_dim=8,
        qk_nope_head_dim=12,
        v_head_dim=16,
        intermediate_size=64,
        moe_intermediate_size=16,
        n_routed_experts=6,
        n_group=2,
        topk_group=1,
        num_experts_per_tok=3,
        n_shared_experts=2,
        first_k_dense_replace=0,
        norm_topk_prob=False,
        routed_scaling_factor=1.5,
        rope_interleave=False,
        tie_word_embeddings=True,
        attention_bias=True,
    ),
    "groups8_yarn_two_dense": dict(
        hidden_size=40,
        num_attention_heads=2,
        q_lora_rank=24,
        kv_lora_rank=28,
        qk_rope_head_dim=12,
        qk_nope_head_dim=16,
        v_head_dim=8,
        intermediate_size=56,
        moe_intermediate_size=12,
        n_routed_experts=16,
        n_group=8,
        topk_group=3,
        num_experts_per_tok=4,
        n_shared_experts=0,
        first_k_dense_replace=2,
        rope_parameters={**YARN, "factor": 2.0},
    ),
}


def build_tiny_deepseek(
    out: Path,
    shape: str,
    *,
    vocab_size: int = 320,
    num_layers: int = 5,
    seed: int = 0,
    **overrides: Any,
) -> DeepseekV3ForCausalLM:
    """Saves a random model to ``out`` (``overrides``: config fields over the shape's);
    returns it in fp32 eval mode."""
    kwargs = {**SHAPES[shape], **overrides}
    kwargs.setdefault("rope_parameters", {"rope_type": "default", "rope_theta": 10000.0})
    kwargs["rope_parameters"].setdefault("rope_theta", 10000.0)
    config = DeepseekV3Config(
        vocab_size=vocab_size,
        num_hidden_layers=num_layers,
        num_key_value_heads=kwargs["num_attention_heads"],
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
        **kwargs,
    )
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():  # larger weights than the default init, so logits are not flat
        for p in model.parameters():
            p.normal_(0, 0.1)
        for layer in model.model.layers:  # a correction bias that changes choices
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None:
                gate.e_score_correction_bias.normal_(0, 0.2)
    model.save_pretrained(out)
    return model


def build_tiny_deepseek_with_mtp(
    out: Path, shape: str, *, vocab_size: int = 320, num_layers: int = 3, seed: int = 0
) -> DeepseekV3ForCausalLM:
    """A random target of ``num_layers`` layers saved with one multi-token-prediction layer
    after them, as DeepSeek-V3 is released (``model.layers.{L}``: a decoder layer with
    experts, ``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm``, ``shared_head.head``
    and its copy of the embedding); returns the target, which never reads that layer."""
    whole = build_tiny_deepseek(
        out, shape, vocab_size=vocab_size, num_layers=num_layers + 1, seed=seed
    )
    tensors = load_file(out / "model.safetensors")
    mtp = f"model.layers.{num_layers}"
    h = whole.config.hidden_size
    gen = torch.Generator().manual_seed(seed + 7)
    tensors[f"{mtp}.enorm.weight"] = 1 + 0.1 * torch.randn(h, generator=gen)
    tensors[f"{mtp}.hnorm.weight"] = 1 + 0.1 * torch.randn(h, generator=gen)
    tensors[f"{mtp}.eh_proj.weight"] = 0.1 * torch.randn(h, 2 * h, generator=gen)
    tensors[f"{mtp}.shared_head.norm.weight"] = 1 + 0.1 * torch.randn(h, generator=gen)
    tensors[f"{mtp}.shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    tensors[f"{mtp}.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, out / "model.safetensors")
    config = json.loads((out / "config.json").read_text())
    config.update(num_hidden_layers=num_layers, num_nextn_predict_layers=1)
    (out / "config.json").write_text(json.dumps(config))
    return DeepseekV3ForCausalLM.from_pretrained(out, dtype=torch.float32).eval()


def make_mtp_know_the_target(out: Path) -> None:
    """Rewrites the model in ``out`` (saved by ``build_tiny_deepseek_with_mtp``) so that its
    layers add nothing (attention and MLP outputs zeroed): each next token follows from
    the current one alone, t_{i+1} = f(t_i). Its MTP layer then passes
    ``enorm(embed(t_{i+1}))`` through (``eh_proj = [I | 0]``, its block adding nothing) and
    scores it with the target's final norm and head: it predicts f(t_{i+1}) = t_{i+2}, so
    its drafts are accepted (reading ``h_i`` first, it would predict t_{i+1} again)."""
    tensors = load_file(out / "model.safetensors")
    for name, t in tensors.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            tensors[name] = torch.zeros_like(t)
    mtp = f"model.layers.{json.loads((out / 'config.json').read_text())['num_hidden_layers']}"
    h = tensors[f"{mtp}.eh_proj.weight"].shape[0]
    tensors[f"{mtp}.eh_proj.weight"] = torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1)
    tensors[f"{mtp}.enorm.weight"] = torch.ones(h)
    tensors[f"{mtp}.shared_head.norm.weight"] = tensors["model.norm.weight"].clone()
    save_file(tensors, out / "model.safetensors")


def write_biased_router(src: Path, dst: Path, bias: list[float]) -> None:
    """``src``'s model in ``dst`` with every router's ``e_score_correction_bias`` set to
    ``bias`` (steering every token to the experts it favours)."""
    dst.mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    tensors = load_file(src / "model.safetensors")
    for name in tensors:
        if name.endswith("e_score_correction_bias"):
            tensors[name] = torch.tensor(bias)
    save_file(tensors, dst / "model.safetensors")

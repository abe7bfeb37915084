"""Shared by the drafter loaders: the draft's Llama config checked against its target, and
building a draft module on the meta device before filling it from safetensors."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn

from engine.config import ConfigError, Llama3Config
from engine.models.layers import RotaryEmbedding
from engine.spec.drafters.base import DraftConfigError
from engine.weights import CheckpointReader, TensorRule, load_weights

M = TypeVar("M", bound=nn.Module)


def init_random(module: nn.Module, seed: int, std: float = 0.02) -> None:
    """Normal weights, zero biases, unit norms; buffers (``d2t``) are zeroed."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith("bias"):
                param.zero_()
            else:
                param.copy_(torch.randn(param.shape, generator=gen) * std)
        for buf_name, buf in module.named_buffers():
            if buf_name.endswith("d2t"):
                buf.zero_()


def save_draft(
    module: nn.Module,
    out_dir: str | Path,
    hf_config: dict[str, Any],
    extra: dict[str, torch.Tensor] | None = None,
    dtype: torch.dtype | None = None,
) -> None:
    """Writes a draft in its public checkpoint layout: fused parameters split back into the
    tensors its loader reads, plus ``config.json``."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    params = dict(module.named_parameters())
    tensors: dict[str, torch.Tensor] = {}
    for rule in module.weight_rules:  # type: ignore[union-attr]
        start = 0
        value = params[rule.dst].detach()
        for src in rule.sources:
            rows = src.shape[0]
            tensors[src.name] = value[start : start + rows].reshape(src.shape)
            start += rows
    tensors.update(extra or {})
    tensors = {
        k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v).contiguous().cpu()
        for k, v in tensors.items()
    }
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")


def draft_llama_config(hf: dict[str, Any], target: Llama3Config) -> Llama3Config:
    """The draft's shapes; RoPE covers the target's context, vocabulary and width must match."""
    hf = dict(hf)
    hf["max_position_embeddings"] = target.max_seq_len  # drafts often declare less
    hf.setdefault("vocab_size", target.vocab_size)
    try:
        config = Llama3Config.from_hf(hf, dtype=target.dtype)
    except ConfigError as e:
        raise DraftConfigError(f"draft config: {e}") from e
    if config.hidden_size != target.hidden_size:
        raise DraftConfigError(
            f"hidden_size: the draft has {config.hidden_size} but the target has "
            f"{target.hidden_size}; a draft shares its target's embedding and must match it"
        )
    if config.vocab_size != target.vocab_size:
        raise DraftConfigError(
            f"vocab_size: the draft has {config.vocab_size} but the target has "
            f"{target.vocab_size}; this draft was trained for another tokenizer"
        )
    return config


def check_layer_ids(name: str, layer_ids: list[int], num_target_layers: int) -> tuple[int, ...]:
    """Target layer ids a draft reads, validated against the target's depth."""
    if not layer_ids or not all(isinstance(i, int) for i in layer_ids):
        raise DraftConfigError(f"{name}: expected a non-empty list of integers, got {layer_ids!r}")
    bad = [i for i in layer_ids if not 0 <= i < num_target_layers]
    if bad:
        raise DraftConfigError(
            f"{name}: layer {bad[0]} does not exist in the target, which has "
            f"{num_target_layers} layers (allowed 0..{num_target_layers - 1})"
        )
    if len(set(layer_ids)) != len(layer_ids):
        raise DraftConfigError(f"{name}: repeated layer ids in {layer_ids}")
    return tuple(layer_ids)


def build_draft(
    factory: Callable[[], M],
    draft_dir: str | Path | None,
    rules: list[TensorRule],
    device: torch.device,
    dtype: torch.dtype,
    load_extra: Callable[[M, CheckpointReader], None] | None = None,
    *,
    seed: int = 0,
    preload: Callable[[M, CheckpointReader], set[str]] | None = None,
) -> M:
    """Builds a draft module on the meta device, materialises it and fills its weights
    (``draft_dir`` None: a fresh random draft, to train or to test with)."""
    with torch.device("meta"):
        module = factory()
    module = module.to_empty(device=device).to(dtype)
    finalize = getattr(module, "finalize", None)
    if finalize is not None:  # what the cast changed back (a router's fp32), before loading
        finalize()
    module.weight_rules = rules  # type: ignore[assignment]  # how to save it again
    for sub in module.modules():
        if isinstance(sub, RotaryEmbedding):
            sub.reset_buffers(device)
    if device.type == "meta":
        return module.eval()
    if draft_dir is None:
        init_random(module, seed)
        return module.eval()
    reader = CheckpointReader(draft_dir)
    try:
        # Parameters another loader fills first (a block-FP8 layer's, dequantized).
        preloaded = preload(module, reader) if preload is not None else set()
        load_weights(module, reader, rules, preloaded)
        if load_extra is not None:
            load_extra(module, reader)
    finally:
        reader.close()
    return module.eval()

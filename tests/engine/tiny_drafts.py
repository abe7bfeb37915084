"""Draft checkpoints for tiny random targets, in each drafter's public layout."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from engine.registry import load_model
from engine.spec.drafters import new_drafter, save_drafter


def draft_hf_config(target_dir: Path, kind: str, **overrides: Any) -> dict[str, Any]:
    """A draft config for the target in ``target_dir``: its shapes, one layer unless set."""
    hf = json.loads((target_dir / "config.json").read_text())
    num_layers = hf["num_hidden_layers"]
    hf = {**hf, "num_hidden_layers": 1, "tie_word_embeddings": False}
    if kind == "eagle":
        hf["architectures"] = ["EagleLlamaForCausalLM"]
    elif kind == "eagle3":
        hf["architectures"] = ["LlamaForCausalLMEagle3"]
        hf["draft_vocab_size"] = hf["vocab_size"]
        hf["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [1, num_layers]}
    else:
        hf["architectures"] = ["DFlashDraftModel"]
        hf["num_hidden_layers"] = 2
        hf["block_size"] = 4
        hf["num_target_layers"] = num_layers
        hf["dflash_config"] = {
            "mask_token_id": hf["vocab_size"] - 1,
            "target_layer_ids": [0, num_layers - 1],
        }
    hf.update(overrides)
    return hf


def build_random_draft(
    target_dir: Path,
    out: Path,
    kind: str,
    seed: int = 0,
    std: float = 0.08,
    d2t: torch.Tensor | None = None,
    **overrides: Any,
) -> Path:
    """Saves a random draft of ``kind`` for the target in ``target_dir`` to ``out``."""
    target, _ = load_model(target_dir, dtype="float32")
    hf = draft_hf_config(target_dir, kind, **overrides)
    drafter = new_drafter(kind, hf, target, torch.device("cpu"), seed)  # type: ignore[arg-type]
    with torch.no_grad():
        for name, p in drafter.named_parameters():  # type: ignore[attr-defined]
            if not name.endswith("norm.weight"):
                p.normal_(0, std, generator=torch.Generator().manual_seed(seed))
        if d2t is not None:
            drafter.d2t.copy_(d2t)  # type: ignore[attr-defined]
    save_drafter(drafter, out, hf)
    return out

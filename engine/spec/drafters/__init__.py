"""Drafters, one file each, declared in one table: kind -> loader."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from engine.config import read_hf_config
from engine.models.llama3 import Llama3Model
from engine.spec.drafters.base import (
    DraftConfigError,
    Drafter,
    DraftLogits,
    DraftSignature,
    ProposeArgs,
    SelectFn,
)
from engine.spec.drafters.dflash import load_dflash
from engine.spec.drafters.eagle import load_eagle
from engine.spec.drafters.eagle3_deepseek_v3 import load_any_eagle3
from engine.spec.drafters.loading import init_random, save_draft

__all__ = [
    "DRAFTERS",
    "DraftConfigError",
    "DraftLogits",
    "DraftSignature",
    "Drafter",
    "ProposeArgs",
    "SelectFn",
    "detect_kind",
    "load_drafter",
]

Loader = Callable[[str | Path | None, dict[str, Any], Llama3Model, torch.device], Drafter]

DRAFTERS: dict[str, Loader] = {
    "eagle": load_eagle,
    "eagle3": load_any_eagle3,
    "dflash": load_dflash,
}


def detect_kind(hf: dict[str, Any]) -> str:
    """The drafter kind a public checkpoint's config.json declares."""
    if isinstance(hf.get("tandem_draft_kind"), str):
        return str(hf["tandem_draft_kind"])
    names = " ".join(hf.get("architectures") or []).lower()
    if "dflash" in names or "dflash_config" in hf:
        return "dflash"
    if "eagle3" in names or "draft_vocab_size" in hf or "eagle_config" in hf:
        return "eagle3"
    if "eagle" in names:
        return "eagle"
    raise DraftConfigError(
        f"architectures: cannot tell the drafter kind from {hf.get('architectures')!r}; "
        f"pass kind= one of {sorted(DRAFTERS)}"
    )


def load_drafter(
    draft_dir: str | Path,
    target: Llama3Model,
    device: torch.device,
    kind: str | None = None,
    layer_ids: tuple[int, ...] | None = None,
) -> Drafter:
    """Reads a draft checkpoint and checks it against ``target``; the message says what misfits."""
    hf = read_hf_config(draft_dir)
    kind = kind or detect_kind(hf)
    if kind not in DRAFTERS:
        raise DraftConfigError(f"kind: {kind!r} is not a drafter; allowed: {sorted(DRAFTERS)}")
    if kind == "eagle3" and layer_ids is not None:
        return load_any_eagle3(draft_dir, hf, target, device, layer_ids)
    if layer_ids is not None:
        raise DraftConfigError(f"target_layer_ids: set in the draft's config for kind {kind!r}")
    return DRAFTERS[kind](draft_dir, hf, target, device)


def new_drafter(
    kind: str, hf: dict[str, Any], target: Llama3Model, device: torch.device, seed: int = 0
) -> Drafter:
    """A randomly initialised draft of ``kind`` shaped by the HF config dict ``hf``."""
    if kind not in DRAFTERS:
        raise DraftConfigError(f"kind: {kind!r} is not a drafter; allowed: {sorted(DRAFTERS)}")
    drafter = DRAFTERS[kind](None, hf, target, device)
    init_random(drafter, seed)  # type: ignore[arg-type]
    return drafter


def save_drafter(
    drafter: Drafter, out_dir: str | Path, hf: dict[str, Any], dtype: torch.dtype | None = None
) -> None:
    """Writes ``drafter`` in its kind's public layout, loadable by ``load_drafter``."""
    extra: dict[str, torch.Tensor] = getattr(drafter, "extra_tensors", dict)()
    save_draft(drafter, out_dir, hf, extra, dtype)  # type: ignore[arg-type]

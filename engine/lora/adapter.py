"""A LoRA adapter in PEFT's format (``adapter_config.json`` and
``adapter_model.safetensors``), read and checked against its base model.

Each target module (a Llama-3 projection: q, k, v, o, gate, up or down) of each layer gets
``A`` [r, in] and ``B`` [out, r]; its delta on input ``x`` is ``(x @ A.T) @ B.T * scaling``,
with ``scaling = alpha / r``, or ``alpha / sqrt(r)`` with ``use_rslora``, as PEFT defines
it. ``rank_pattern`` and ``alpha_pattern`` give some modules their own ``r`` and alpha: a
key applies to the modules whose name ends with it (the name, or a dotted suffix of it;
PEFT's rule), the first key that applies winning.

Refused, naming the field: a target Tandem does not run, a rank above ``max_rank``,
tensors of shapes another base model would have, and what PEFT can save but Tandem does
not apply (trained biases, ``modules_to_save``, DoRA, ``fan_in_fan_out``).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
PREFIX = "base_model.model."  # PEFT's names: the wrapped model's, under this prefix


class LoraError(ValueError):
    """An adapter Tandem cannot serve on this base; the message names the field."""


@dataclass(frozen=True)
class LoraWeights:
    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [out, r]
    scaling: float

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass(frozen=True)
class LoraAdapter:
    name: str
    path: Path
    base_model: str | None  # its config's base_model_name_or_path, as PEFT saved it
    modules: dict[str, LoraWeights]  # "model.layers.{i}.{self_attn|mlp}.{target}" ->

    @property
    def max_rank(self) -> int:
        return max((w.rank for w in self.modules.values()), default=0)


def _pattern(patterns: Mapping[str, Any], module: str, default: Any) -> Any:
    """The value of the first key of ``patterns`` that ``module`` ends with, else
    ``default`` (PEFT's rank_pattern and alpha_pattern)."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _targets(config: dict[str, Any]) -> set[str]:
    """The projection names the adapter's ``target_modules`` name (a list, or a regex
    over module names); refused where it names one Tandem does not run."""
    targets = config.get("target_modules")
    if isinstance(targets, str):  # a regex over full module names
        return {t for t in TARGETS if re.fullmatch(targets, f"model.layers.0.x.{t}")}
    names = set(targets or ())
    unknown = sorted(names - set(TARGETS))
    if unknown:
        raise LoraError(f"target_modules: {unknown} not supported; supported: {list(TARGETS)}")
    return names


def load_adapter(
    name: str,
    path: str | Path,
    shapes: Mapping[str, tuple[int, int]],  # target -> (out, in) of the base projection
    num_layers: int,
    max_rank: int,
) -> LoraAdapter:
    """Reads and checks the PEFT adapter in ``path`` for a base whose projections have
    ``shapes`` over ``num_layers`` layers."""
    path = Path(path)
    config_file = path / CONFIG_FILE
    if not config_file.is_file():
        raise LoraError(f"{name}: {path} holds no {CONFIG_FILE} (a PEFT LoRA adapter)")
    config = json.loads(config_file.read_text())
    if config.get("peft_type", "LORA") != "LORA":
        raise LoraError(f"peft_type: {config['peft_type']!r}; only LORA adapters run")
    for field, allowed in (("bias", "none"), ("use_dora", False), ("fan_in_fan_out", False)):
        if config.get(field, allowed) not in (allowed, None):
            raise LoraError(f"{field}: {config[field]!r} is not supported; allowed: {allowed!r}")
    if config.get("modules_to_save"):
        raise LoraError(
            f"modules_to_save: {config['modules_to_save']} (fully trained modules) are not "
            "supported"
        )
    targets = _targets(config)
    r_default, alpha_default = int(config["r"]), float(config.get("lora_alpha", 8))
    ranks, alphas = config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}
    rslora = bool(config.get("use_rslora", False))
    tensors = load_file(path / WEIGHTS_FILE)
    modules: dict[str, LoraWeights] = {}
    for i in range(num_layers):
        for target in sorted(targets):
            part = "self_attn" if target in TARGETS[:4] else "mlp"
            module = f"model.layers.{i}.{part}.{target}"
            a_name, b_name = f"{PREFIX}{module}.lora_A.weight", f"{PREFIX}{module}.lora_B.weight"
            if a_name not in tensors:  # layers_to_transform and the like: not adapted
                continue
            a, b = tensors.pop(a_name), tensors.pop(b_name)
            r = int(_pattern(ranks, module, r_default))
            if r > max_rank:
                field = "r" if r == r_default else f"rank_pattern of {module}"
                raise LoraError(f"{field}: {r} exceeds the largest rank served, {max_rank}")
            out_features, in_features = shapes[target]
            if a.shape != (r, in_features) or b.shape != (out_features, r):
                raise LoraError(
                    f"{a_name}: {list(a.shape)} and {b_name}: {list(b.shape)}; a base whose "
                    f"{target} maps {in_features} to {out_features} features at rank {r} "
                    "needs [r, in] and [out, r] (an adapter for another base model?)"
                )
            alpha = float(_pattern(alphas, module, alpha_default))
            scaling = alpha / (math.sqrt(r) if rslora else r)
            modules[module] = LoraWeights(a.float(), b.float(), scaling)
    if tensors:
        raise LoraError(f"{sorted(tensors)[0]}: a tensor no target of this base takes")
    return LoraAdapter(name, path, config.get("base_model_name_or_path"), modules)

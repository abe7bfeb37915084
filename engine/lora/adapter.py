"""A LoRA adapter in PEFT's format (``adapter_config.json`` and
``adapter_model.safetensors``), read and checked against its base model.

Each target module (a Llama-3 projection: q, k, v, o, gate, up or down) of each layer gets
``A`` [r, in] and ``B`` [out, r]; its delta on input ``x`` is ``(x @ A.T) @ B.T * scaling``,
with ``scaling = alpha / r``, or ``alpha / sqrt(r)`` with ``use_rslora``, as PEFT defines
it. ``rank_pattern`` and ``alpha_pattern`` give some modules their own ``r`` and alpha: a
key applies to the modules whose name ends with it (the name, or a dotted suffix of it;
PEFT's rule), the first key that applies winning.

Refused, naming the field: a target Tandem does not run, a rank above ``max_rank``, and
what PEFT can save but Tandem does not apply (trained biases, ``modules_to_save``, DoRA,
QALoRA, activated LoRA, trainable tokens, ``fan_in_fan_out``); naming the tensor:
tensors of shapes another base model would have, or that no target takes.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

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
    # Its files' digest: what its requests' prefix-cache hashes chain on, so that KV made
    # under it is never another adapter's (nor one loaded later under the same name).
    salt: int = 0

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


def _targeting(config: dict[str, Any]) -> Callable[[str], bool]:
    """Whether the adapter's ``target_modules`` names a module (by its full name), as PEFT
    reads them: a regex over full names, or names each matching a module whose name is
    it or ends with it after a dot. Refused where a listed name ends in no projection
    Tandem adapts."""
    targets = config.get("target_modules")
    if isinstance(targets, str):
        pattern = re.compile(targets)
        return lambda module: pattern.fullmatch(module) is not None
    names = list(targets or ())
    unknown = [n for n in names if n.rsplit(".", 1)[-1] not in TARGETS]
    if unknown:
        raise LoraError(f"target_modules: {unknown} not supported; supported: {list(TARGETS)}")
    return lambda module: any(module == n or module.endswith("." + n) for n in names)


def load_adapter(
    name: str,
    path: str | Path,
    shapes: Mapping[str, tuple[int, int]],  # target -> (out, in) of the base projection
    num_layers: int,
    max_rank: int,
    device: torch.device | str = "cpu",
) -> LoraAdapter:
    """Reads and checks the PEFT adapter in ``path`` for a base whose projections have
    ``shapes`` over ``num_layers`` layers."""
    path = Path(path)
    config_file = path / CONFIG_FILE
    if not config_file.is_file():
        raise LoraError(f"{name}: {path} holds no {CONFIG_FILE} (a PEFT LoRA adapter)")
    try:
        config = json.loads(config_file.read_text())
    except (ValueError, OSError) as e:
        raise LoraError(f"{CONFIG_FILE}: unreadable in {path} ({e})") from None
    if not isinstance(config, dict) or not isinstance(config.get("r"), int):
        raise LoraError(f"{CONFIG_FILE}: in {path}, not a LoRA config (no integer r)")
    if config.get("peft_type", "LORA") != "LORA":
        raise LoraError(f"peft_type: {config['peft_type']!r}; only LORA adapters run")
    for field, allowed in (
        ("bias", "none"),
        ("use_dora", False),
        ("fan_in_fan_out", False),
        ("lora_bias", False),
        ("use_qalora", False),
        ("alora_invocation_tokens", None),  # activated LoRA: deltas from those tokens on
        ("trainable_token_indices", None),
    ):
        if config.get(field, allowed) not in (allowed, None):
            raise LoraError(f"{field}: {config[field]!r} is not supported; allowed: {allowed!r}")
    if config.get("modules_to_save"):
        raise LoraError(
            f"modules_to_save: {config['modules_to_save']} (fully trained modules) are not "
            "supported"
        )
    targets = _targeting(config)
    r_default, alpha_default = int(config["r"]), float(config.get("lora_alpha", 8))
    ranks, alphas = config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}
    rslora = bool(config.get("use_rslora", False))
    try:
        weights_bytes = (path / WEIGHTS_FILE).read_bytes()  # read once: tensors and digest
        tensors = safetensors.torch.load(weights_bytes)
    except Exception as e:  # safetensors' own error type, or the OS's
        raise LoraError(f"{WEIGHTS_FILE}: unreadable in {path} ({e})") from None
    modules: dict[str, LoraWeights] = {}
    for i in range(num_layers):
        for target in TARGETS:
            part = "self_attn" if target in TARGETS[:4] else "mlp"
            module = f"model.layers.{i}.{part}.{target}"
            a_name, b_name = f"{PREFIX}{module}.lora_A.weight", f"{PREFIX}{module}.lora_B.weight"
            if not targets(module) or a_name not in tensors:  # layers_to_transform: not here
                continue
            if b_name not in tensors:
                raise LoraError(f"{b_name}: missing beside {a_name}")
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
            modules[module] = LoraWeights(
                a.to(device, torch.float32), b.to(device, torch.float32), scaling
            )
    if tensors:
        raise LoraError(f"{sorted(tensors)[0]}: a tensor no target of this base takes")
    digest = hashlib.blake2b(config_file.read_bytes(), digest_size=8)
    digest.update(weights_bytes)
    salt = int.from_bytes(digest.digest(), "little") >> 1  # an int64: chains prefix hashes
    return LoraAdapter(name, path, config.get("base_model_name_or_path"), modules, salt)

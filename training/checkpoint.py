"""Resumable training state without pickle: the draft in its public layout (fp32), the
optimizer's tensors in safetensors and everything else in JSON."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.spec.drafters import Drafter, save_drafter

# In a subfolder: the weight loader reads every *.safetensors beside config.json.
OPTIMIZER_FILE = "optimizer/adamw.safetensors"
STATE_FILE = "state.json"


@dataclass
class CheckpointState:
    meta: dict[str, Any]  # kind, epochs done, history
    param_groups: list[dict[str, Any]]
    tensors: dict[str, torch.Tensor]  # "param_index.name" -> optimizer state tensor

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """A ``state_dict`` for ``optimizer`` (built over the same parameters, same order)."""
        state: dict[int, dict[str, torch.Tensor]] = {}
        for key, value in self.tensors.items():
            index, name = key.split(".", 1)
            state.setdefault(int(index), {})[name] = value
        groups = optimizer.state_dict()["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError("checkpoint: optimizer parameter groups do not match")
        merged = [
            {**saved, "params": group["params"]}
            for saved, group in zip(self.param_groups, groups, strict=True)
        ]
        return {"state": state, "param_groups": merged}


def save_checkpoint(
    path: Path,
    drafter: Drafter,
    hf: dict[str, Any],
    optimizer: torch.optim.Optimizer,
    meta: dict[str, Any],
) -> None:
    """Writes the checkpoint next to ``path`` and swaps it in, so a crash keeps the old one."""
    from safetensors.torch import save_file

    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    save_drafter(drafter, tmp, hf)
    opt = optimizer.state_dict()
    tensors = {
        f"{index}.{name}": value.detach().clone().contiguous()
        for index, entries in opt["state"].items()
        for name, value in entries.items()
        if isinstance(value, torch.Tensor)
    }
    (tmp / OPTIMIZER_FILE).parent.mkdir()
    save_file(tensors, str(tmp / OPTIMIZER_FILE))
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt["param_groups"]]
    state = {"meta": meta, "param_groups": groups}
    (tmp / STATE_FILE).write_text(json.dumps(state, indent=2) + "\n")
    old = path.with_name(path.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if path.exists():
        path.rename(old)
    tmp.rename(path)
    shutil.rmtree(old, ignore_errors=True)


def load_checkpoint(path: Path) -> CheckpointState | None:
    """The saved state, or None when ``path`` holds no finished checkpoint."""
    from safetensors.torch import load_file

    if not (path / STATE_FILE).is_file():
        return None
    state = json.loads((path / STATE_FILE).read_text())
    return CheckpointState(state["meta"], state["param_groups"], load_file(path / OPTIMIZER_FILE))

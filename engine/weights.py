"""Loading safetensors checkpoints (single file or sharded with an index) into a model.

An architecture declares how checkpoint tensors map onto its parameters as a list of
``TensorRule``s (its weight adapter); this module checks every source tensor's presence
and shape and names the tensor when something is wrong.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn


class WeightError(ValueError):
    """A checkpoint that does not fit the model; the message names the tensor."""


@dataclass(frozen=True)
class Part:
    """Rows (``dim`` 0) or columns (``dim`` 1) ``[start, stop)`` of a checkpoint tensor:
    what one tensor-parallel rank reads of it, and all it reads (engine.parallel.shard)."""

    dim: int
    start: int
    stop: int


@dataclass(frozen=True)
class Source:
    name: str  # tensor name in the checkpoint
    shape: tuple[int, ...]  # shape the checkpoint must have
    part: Part | None = None  # None: all of it


@dataclass(frozen=True)
class TensorRule:
    """Parameter ``dst`` is its sources concatenated along dim 0, in order."""

    dst: str
    sources: tuple[Source, ...]


def one_rule(dst: str, src: str, shape: tuple[int, ...], part: Part | None = None) -> TensorRule:
    """Parameter ``dst`` from the one tensor ``src`` (or its ``part``)."""
    return TensorRule(dst, (Source(src, shape, part),))


def run_part(dim: int, run: range, scale: int = 1) -> Part:
    """``run`` of heads or channels (each ``scale`` rows or columns wide) as a Part."""
    return Part(dim, run.start * scale, run.stop * scale)


class CheckpointReader:
    """Name -> file index over a checkpoint directory; tensors are read lazily."""

    def __init__(self, model_dir: str | Path) -> None:
        self.model_dir = Path(model_dir)
        self.files = self._index()
        self._stack = ExitStack()
        self._handles: dict[Path, Any] = {}

    def _index(self) -> dict[str, Path]:
        index_path = self.model_dir / "model.safetensors.index.json"
        if index_path.is_file():
            weight_map: dict[str, str] = json.loads(index_path.read_text())["weight_map"]
            files = {name: self.model_dir / fname for name, fname in weight_map.items()}
            for path in set(files.values()):
                if not path.is_file():
                    raise WeightError(f"{path.name}: listed in {index_path.name} but missing")
            return files
        shards = sorted(self.model_dir.glob("*.safetensors"))
        if not shards:
            raise WeightError(f"no *.safetensors files in {self.model_dir}")
        files = {}
        for path in shards:
            with safe_open(str(path), framework="pt") as f:
                files.update({name: path for name in f.keys()})  # noqa: SIM118
        return files

    def names(self) -> set[str]:
        return set(self.files)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(name).get_slice(name).get_shape())

    def dtype(self, name: str) -> str:
        """The tensor's safetensors dtype ("BF16", "F32", "F8_E4M3", ...), read from its header."""
        dtype: str = self._handle(name).get_slice(name).get_dtype()
        return dtype

    def get(self, name: str, part: Part | None = None) -> torch.Tensor:
        """The tensor, or only ``part`` of it (read from the file without the rest)."""
        if part is None:
            tensor: torch.Tensor = self._handle(name).get_tensor(name)
            return tensor
        sliced = self._handle(name).get_slice(name)
        if part.dim == 0:
            rows: torch.Tensor = sliced[part.start : part.stop]
            return rows
        if part.dim == 1:
            columns: torch.Tensor = sliced[:, part.start : part.stop]
            return columns
        raise ValueError(f"part: dim {part.dim}, must be 0 (rows) or 1 (columns)")

    def _handle(self, name: str) -> Any:
        if name not in self.files:
            raise WeightError(f"{name}: missing from the checkpoint in {self.model_dir}")
        path = self.files[name]
        if path not in self._handles:
            self._handles[path] = self._stack.enter_context(safe_open(str(path), framework="pt"))
        return self._handles[path]

    def close(self) -> None:
        self._stack.close()


def check_source(reader: CheckpointReader, src: Source) -> tuple[int, ...]:
    """``src``'s shape in the checkpoint; raises WeightError, naming the tensor, where it
    is not the config's or ``src.part`` lies outside it."""
    shape = reader.shape(src.name)
    if shape != src.shape:
        raise WeightError(
            f"{src.name}: shape {list(shape)} does not match the config's {list(src.shape)}"
        )
    part = src.part
    if part is not None and not 0 <= part.start < part.stop <= shape[part.dim]:
        raise WeightError(
            f"{src.name}: part [{part.start}, {part.stop}) of dim {part.dim} is outside its "
            f"shape {list(shape)}"
        )
    return shape


def load_weights(
    model: nn.Module,
    reader: CheckpointReader,
    rules: Iterable[TensorRule],
    preloaded: Iterable[str] = (),
) -> None:
    """Fills every parameter of ``model`` from the checkpoint, validating names and shapes;
    ``preloaded``: parameters another loader filled already (engine.fp8's)."""
    params = dict(model.named_parameters())
    filled: set[str] = set(preloaded)
    for rule in rules:
        if rule.dst not in params:
            raise WeightError(f"{rule.dst}: adapter targets an unknown parameter")
        parts = []
        for src in rule.sources:
            if reader.dtype(src.name) == "F8_E4M3":  # its scale would be lost in a cast
                raise WeightError(
                    f"{src.name}: float8_e4m3fn, but {rule.dst} is no block-FP8 projection "
                    "(a draft's weights, an LM head, or a checkpoint without its "
                    "quantization_config): not supported"
                )
            check_source(reader, src)
            parts.append(reader.get(src.name, src.part))
        tensor = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
        param = params[rule.dst]
        with torch.no_grad():
            param.copy_(tensor.to(param.dtype))
        filled.add(rule.dst)
    unfilled = set(params) - filled
    # A tied lm_head shares its tensor with the embedding: filled through the embedding.
    unfilled -= {n for n, p in params.items() if any(p is params[f] for f in filled)}
    if unfilled:
        raise WeightError(f"{sorted(unfilled)[0]}: no checkpoint tensor loads this parameter")

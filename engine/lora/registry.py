"""An engine's LoRA adapters by name, loaded at start (``EngineConfig.lora_modules``) and
at run time (``load``, ``unload``).

Each adapter has an id, the ``lora_ids`` its requests' rows carry, and a digest of its
files, which its requests' prefix-cache hashes chain on. Ids are never reused: an
adapter loaded after another was unloaded gets a new one. ``names`` is replaced, never
changed in place, so that another thread may read it while the engine's thread loads.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import nn

from engine.config import Llama3Config
from engine.lora.adapter import TARGETS, LoraAdapter, LoraError, load_adapter
from engine.lora.layers import put_adapter, use_lora


class LoraInUse(LoraError):
    """An adapter that requests run under cannot be unloaded now."""


class LoraNotLoaded(LoraError):
    """No adapter has that name."""


class LoraRegistry:
    """The adapters of ``model`` (a Llama-3 on one device) and their ids (see the
    module's docstring)."""

    def __init__(
        self, model: nn.Module, config: Llama3Config, max_rank: int, device: torch.device
    ) -> None:
        self.model, self.max_rank, self.device = model, max_rank, device
        self.num_layers = config.num_hidden_layers
        q, kv, h, inter = (
            config.q_size,
            config.kv_size,
            config.hidden_size,
            config.intermediate_size,
        )
        widths = (q, kv, kv, h, inter, inter, h)
        inputs = (h, h, h, q, h, h, inter)
        # target -> (out, in) of the base projection: what an adapter's shapes must fit
        self.shapes = {t: (o, i) for t, o, i in zip(TARGETS, widths, inputs, strict=True)}
        self.names: dict[str, tuple[int, int]] = {}  # name -> (id, digest)
        self._next_id = 0

    def start(self, modules: Sequence[tuple[str, str]]) -> None:
        """The adapters given at start, read and checked, then swapped into the model
        (which gets its ``LoraStep`` even with none, for adapters loaded later)."""
        adapters = [self._read(name, path) for name, path in modules]
        use_lora(self.model, adapters)
        self.names = {a.name: (i, a.salt) for i, a in enumerate(adapters)}
        self._next_id = len(adapters)

    def load(self, name: str, path: str | Path) -> None:
        """Reads, checks and puts in one more adapter; LoraError (naming the field) for one
        that cannot be served, or a name already loaded."""
        if name in self.names:
            raise LoraError(f"lora_name: {name!r} is already loaded")
        adapter = self._read(name, path)
        adapter_id = self._next_id
        put_adapter(self.model, adapter_id, adapter)
        self._next_id += 1
        self.names = {**self.names, name: (adapter_id, adapter.salt)}

    def unload(self, name: str, num_requests: Callable[[int], int]) -> None:
        """Takes adapter ``name`` out; LoraError while ``num_requests(id)`` requests (of
        the engine's) run under it, or when no adapter has that name."""
        if name not in self.names:
            raise LoraNotLoaded(f"lora_name: {name!r} is not loaded; loaded: {sorted(self.names)}")
        adapter_id = self.names[name][0]
        running = num_requests(adapter_id)
        if running:
            raise LoraInUse(
                f"lora_name: {name!r} has {running} requests in flight; unload it once they end"
            )
        put_adapter(self.model, adapter_id, None)
        self.names = {k: v for k, v in self.names.items() if k != name}

    def _read(self, name: str, path: str | Path) -> LoraAdapter:
        return load_adapter(name, path, self.shapes, self.num_layers, self.max_rank, self.device)

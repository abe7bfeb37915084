"""An engine's LoRA adapters by name, loaded at start (``EngineConfig.lora_modules``) and
at run time (``load``, ``unload``).

Each adapter has an id, the ``lora_ids`` its requests' rows carry, and a digest of its
files, which its requests' prefix-cache hashes chain on. Ids are never reused: an
adapter loaded after another was unloaded gets a new one. ``names`` is replaced, never
changed in place, so that another thread may read it while the engine's thread loads.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import nn

from engine.config import Llama3Config
from engine.lora.adapter import TARGETS, LoraAdapter, LoraError, load_adapter
from engine.lora.layers import put_adapter, use_lora


def _none(adapter_id: int) -> int:
    return 0


def _kept(adapter_id: int) -> int:
    """At start every adapter in memory stays: the first ``max_resident`` given."""
    return 1


class LoraInUse(LoraError):
    """An adapter that requests run under cannot be unloaded now."""


class LoraNotLoaded(LoraError):
    """No adapter has that name."""


class LoraMemoryFull(LoraError):
    """Every adapter kept in memory (``max_cpu_loras``) has requests: none can make room
    for another now; retry once some end."""


class LoraRegistry:
    """The adapters of ``model`` (a Llama-3 on one device) and their ids (see the
    module's docstring). At most ``max_resident`` adapters' weights are in memory (None:
    every one): the others are known by name, path and digest, and read again when a
    request names one, in place of the least recently used adapter no request runs under."""

    def __init__(
        self,
        model: nn.Module,
        config: Llama3Config,
        max_rank: int,
        device: torch.device,
        max_resident: int | None = None,
    ) -> None:
        self.model, self.max_rank, self.device = model, max_rank, device
        self.max_resident = max_resident
        self.num_layers = config.num_hidden_layers
        q, kv, h = config.q_size, config.kv_size, config.hidden_size
        inter = config.intermediate_size
        widths = (q, kv, kv, h, inter, inter, h)
        inputs = (h, h, h, q, h, h, inter)
        # target -> (out, in) of the base projection: what an adapter's shapes must fit
        self.shapes = {t: (o, i) for t, o, i in zip(TARGETS, widths, inputs, strict=True)}
        self.names: dict[str, tuple[int, int]] = {}  # name -> (id, digest)
        self.paths: dict[int, Path] = {}  # id -> the adapter's directory
        self.resident: OrderedDict[int, None] = OrderedDict()  # in memory, least recent first
        self.num_reads = 0  # adapters read from their files, at start and since
        self._next_id = 0

    def start(self, modules: Sequence[tuple[str, str]]) -> None:
        """The adapters given at start, read and checked (the first ``max_resident`` kept
        in the model), so that the model has its ``LoraStep`` even with none."""
        use_lora(self.model, [])
        for name, path in modules:
            self.load(name, path, num_requests=_kept)

    def load(self, name: str, path: str | Path, num_requests: Callable[[int], int] = _none) -> None:
        """Reads, checks and registers one more adapter, kept in memory if there is room
        (or an adapter without requests to make room); LoraError (naming the field) for
        one that cannot be served, or a name already loaded."""
        if name in self.names:
            raise LoraError(f"lora_name: {name!r} is already loaded")
        adapter = self._read(name, path)
        adapter_id = self._next_id
        self._next_id += 1
        self.paths[adapter_id] = Path(path)
        self.names = {**self.names, name: (adapter_id, adapter.salt)}
        if self._make_room(num_requests):
            self._put(adapter_id, adapter)

    def use(self, name: str, num_requests: Callable[[int], int]) -> tuple[int, int]:
        """Adapter ``name``'s (id, digest) for a new request, its weights in the model
        (read again, in place of the least recently used adapter no request runs under,
        if they were not); LoraMemoryFull when every adapter in memory has requests."""
        adapter_id, digest = self.names[name]
        if adapter_id in self.resident:
            self.resident.move_to_end(adapter_id)
            return adapter_id, digest
        if not self._make_room(num_requests):
            raise LoraMemoryFull(
                f"model: adapter {name!r} is not in memory, and each of the "
                f"{self.max_resident} adapters that are (--max-cpu-loras) has requests; "
                "retry later"
            )
        adapter = self._read(name, self.paths[adapter_id])
        if adapter.salt != digest:
            raise LoraError(
                f"model: adapter {name!r}'s files in {self.paths[adapter_id]} changed since "
                "it was loaded; load it again under another name"
            )
        self._put(adapter_id, adapter)
        return adapter_id, digest

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
        if adapter_id in self.resident:
            put_adapter(self.model, adapter_id, None)
            del self.resident[adapter_id]
        del self.paths[adapter_id]
        self.names = {k: v for k, v in self.names.items() if k != name}

    def _make_room(self, num_requests: Callable[[int], int]) -> bool:
        """Whether one more adapter fits in memory, once the least recently used one
        without requests is taken out if need be."""
        if self.max_resident is None or len(self.resident) < self.max_resident:
            return True
        for adapter_id in self.resident:
            if not num_requests(adapter_id):
                put_adapter(self.model, adapter_id, None)
                del self.resident[adapter_id]
                return True
        return False

    def _put(self, adapter_id: int, adapter: LoraAdapter) -> None:
        put_adapter(self.model, adapter_id, adapter)
        self.resident[adapter_id] = None

    def _read(self, name: str, path: str | Path) -> LoraAdapter:
        self.num_reads += 1
        return load_adapter(name, path, self.shapes, self.num_layers, self.max_rank, self.device)

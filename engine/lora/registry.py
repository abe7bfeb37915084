"""An engine's LoRA adapters by name, loaded at start (``EngineConfig.lora_modules``) and
at run time (``load``, ``unload``).

An adapter has a digest of its files, which its requests' prefix-cache hashes chain on,
and while its weights are in the model, a slot: the ``lora_ids`` its requests' rows
carry (``Sequence.lora_id``). Slots are reused: one freed by an unloaded adapter, or by
one taken out of memory (``max_resident``, the least recently used without requests),
goes to the next adapter put in, so that the stacked weights a step reads
(``engine.lora.ops``: ``CpuSgmv``, ``DenseLora``) hold only the adapters in memory. A slot
changes hands only while no request runs under it.

In a model split over tensor-parallel ranks, every rank's registry starts from the same
adapters, in the same slots. After that, rank 0's alone decides: each adapter it puts in
a slot or takes out travels with its next forward's step message (``LoraChange``), and the
other ranks do the same to theirs (``apply``), reading their part of the same files.

``names`` is replaced, never changed in place, so that another thread may read it while
the engine's thread loads.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from engine.config import Llama3Config
from engine.lora.adapter import TARGETS, LoraAdapter, LoraError, LoraWeights, load_adapter
from engine.lora.layers import LoraChange, LoraStep, put_adapter, use_lora
from engine.parallel.shard import Shard

NumRequests = Callable[[int], int]  # requests (of the engine's) under a slot


def _none(slot: int) -> int:
    return 0


def _kept(slot: int) -> int:
    """At start every adapter in memory stays: the first ``max_resident`` given."""
    return 1


class LoraInUse(LoraError):
    """An adapter that requests run under cannot be unloaded now (FAILED_PRECONDITION)."""


class LoraNotLoaded(LoraError):
    """No adapter has that name (NOT_FOUND)."""


class LoraMismatch(LoraError):
    """A worker's request names an adapter this engine does not hold with the digest the
    router saw (unloaded, or loaded again from other files, since): FAILED_PRECONDITION,
    so that the router picks another worker."""


class LoraMemoryFull(LoraError):
    """Every adapter kept in memory (``max_cpu_loras``) has requests: none can make room
    for another now; retry once some end (RESOURCE_EXHAUSTED)."""


def shard_adapter(adapter: LoraAdapter, config: Llama3Config, shard: Shard) -> LoraAdapter:
    """``adapter``'s part on one tensor-parallel rank, split as the base projections are:
    ``B``'s output rows where the projection splits its output (q, k, v by heads, gate and
    up by channels; A whole), ``A``'s input columns where it splits its input (o by query
    heads, down by channels; B whole, the deltas summed by the projection's all-reduce)."""
    hd = config.head_dim
    heads = shard.even(config.num_attention_heads, "num_attention_heads")
    kv_heads = shard.kv_heads(config.num_key_value_heads)
    channels = shard.even(config.intermediate_size, "intermediate_size")
    q = slice(heads.start * hd, heads.stop * hd)
    kv = slice(kv_heads.start * hd, kv_heads.stop * hd)
    mlp = slice(channels.start, channels.stop)
    outputs = {"q_proj": q, "k_proj": kv, "v_proj": kv, "gate_proj": mlp, "up_proj": mlp}
    inputs = {"o_proj": q, "down_proj": mlp}
    modules: dict[str, LoraWeights] = {}
    for name, w in adapter.modules.items():
        target = name.rsplit(".", 1)[-1]
        if target in outputs:
            w = LoraWeights(w.a, w.b[outputs[target]].contiguous(), w.scaling)
        else:
            w = LoraWeights(w.a[:, inputs[target]].contiguous(), w.b, w.scaling)
        modules[name] = w
    return dataclasses.replace(adapter, modules=modules)


def lora_registry(
    config: Any,  # an EngineConfig or a RankConfig: the same fields
    model: nn.Module,
    model_config: Any,
    shard: Shard | None = None,  # a tensor-parallel rank's; None: one device
) -> LoraRegistry | None:
    """The engine's adapters: ``config.lora_modules`` read, checked against the model (split
    for ``shard``) and swapped into it; None without adapters or ``enable_lora``. Every
    rank of a split model builds its own, in the same order: the same slots."""
    enable = getattr(config, "enable_lora", False)
    if not config.lora_modules and not enable:
        return None
    if not isinstance(model_config, Llama3Config):
        raise ValueError("lora_modules: LoRA adapters run on Llama-3 models only for now")
    device = next(model.parameters()).device
    max_resident = getattr(config, "max_cpu_loras", None)
    registry = LoraRegistry(model, model_config, config.max_lora_rank, device, max_resident, shard)
    compiled = bool(getattr(config, "torch_compile", False))
    registry.start([(name, path) for name, path in config.lora_modules], compiled=compiled)
    return registry


class LoraRegistry:
    """The adapters of ``model`` (a Llama-3 on one device), their digests and slots (see
    the module's docstring). At most ``max_resident`` adapters' weights are in memory
    (None: every one): the others are known by name, path and digest, and read again
    when a request names one."""

    def __init__(
        self,
        model: nn.Module,
        config: Llama3Config,
        max_rank: int,
        device: torch.device,
        max_resident: int | None = None,
        shard: Shard | None = None,  # a tensor-parallel rank's: adapters split for it
    ) -> None:
        self.model, self.max_rank, self.device = model, max_rank, device
        self.max_resident, self.config = max_resident, config
        self.num_layers = config.num_hidden_layers
        q, kv, h = config.q_size, config.kv_size, config.hidden_size
        inter = config.intermediate_size
        widths = (q, kv, kv, h, inter, inter, h)
        inputs = (h, h, h, q, h, h, inter)
        # target -> (out, in) of the base projection: what an adapter's shapes must fit
        self.shapes = {t: (o, i) for t, o, i in zip(TARGETS, widths, inputs, strict=True)}
        self.names: dict[str, tuple[int, int]] = {}  # name -> (slot or -1, digest)
        self.paths: dict[str, Path] = {}
        self.resident: OrderedDict[str, int] = OrderedDict()  # name -> slot, least recent first
        self._free: list[int] = []  # slots freed, reused first
        self.shard = shard
        # Rank 0 of a split model, once started: its puts and take-outs are queued on the
        # model's LoraStep for the other ranks (``apply``)
        self._mirrored = False
        self._num_slots = 0
        self.num_reads = 0  # adapters read from their files, at start and since
        self._reads_lock = threading.Lock()

    def start(self, modules: Sequence[tuple[str, str]], *, compiled: bool = False) -> None:
        """The adapters given at start, read and checked (the first ``max_resident`` kept
        in the model), so that the model has its ``LoraStep`` even with none. ``compiled``:
        every projection takes deltas from now on (``use_lora``'s ``every_projection``),
        so that adapters put in later change no module of the compiled model."""
        use_lora(self.model, [], every_projection=compiled)
        for name, path in modules:
            self.load(name, path, num_requests=_kept)
        self._mirrored = self.shard is not None and self.shard.size > 1 and self.shard.rank == 0

    def apply(self, changes: Sequence[tuple[int, str | None, str, int]]) -> None:
        """On a tensor-parallel rank other than 0: rank 0's adapter changes since its last
        forward (``LoraChange``s), done to this rank's model, each adapter read from the
        same files (this rank's part); LoraMismatch if they are not the files rank 0 read."""
        for slot, name, path, salt in changes:
            if name is None:
                put_adapter(self.model, slot, None)
                continue
            adapter = self.read(name, path)
            if adapter.salt != salt:
                raise LoraMismatch(
                    f"model: adapter {name!r}'s files in {path} are not the ones rank 0 read"
                )
            put_adapter(self.model, slot, adapter)

    def load(
        self,
        name: str,
        path: str | Path,
        num_requests: NumRequests = _none,
        adapter: LoraAdapter | None = None,
    ) -> None:
        """Reads (unless ``adapter``: ``read``'s, done already), checks and registers one
        more adapter, kept in memory if there is room (or an adapter without requests to
        make room); LoraError (naming the field) for one that cannot be served, or a name
        already loaded."""
        if name in self.names:
            raise LoraError(f"lora_name: {name!r} is already loaded")
        if adapter is None:
            adapter = self.read(name, path)
        self.paths[name] = Path(path)
        self._publish(name, -1, adapter.salt)
        if self._make_room(num_requests):
            self._put(adapter)

    def use(
        self, name: str, num_requests: NumRequests, digest: int | None = None
    ) -> tuple[int, int]:
        """Adapter ``name``'s (slot, digest) for a new request, its weights in the model
        (read again, in place of the least recently used adapter no request runs under,
        if they were not). ``digest``: the one a worker's router saw; LoraMismatch if it
        is not this adapter's, or for a name not loaded. LoraMemoryFull when every
        adapter in memory has requests."""
        if name not in self.names:
            raise LoraMismatch(f"model: this worker has no adapter {name!r} (unloaded since?)")
        _, salt = self.names[name]
        if digest is not None and digest != salt:
            raise LoraMismatch(
                f"model: this worker's adapter {name!r} is not the one the router routed to "
                "(loaded again from other files since?)"
            )
        if name in self.resident:
            self.resident.move_to_end(name)
            return self.resident[name], salt
        if not self._make_room(num_requests):
            raise LoraMemoryFull(
                f"model: adapter {name!r} is not in memory, and each of the "
                f"{self.max_resident} adapters that are (--max-cpu-loras) has requests; "
                "retry later"
            )
        try:
            adapter = self.read(name, self.paths[name])
        except LoraError as e:  # its files are gone or broken: not this worker's to serve
            self._forget(name)
            raise LoraMismatch(f"model: adapter {name!r} cannot be read again ({e})") from None
        if adapter.salt != salt:
            self._forget(name)
            path = self.paths.pop(name)
            raise LoraMismatch(
                f"model: adapter {name!r}'s files in {path} changed since it was loaded; it "
                "is unloaded here (load it again)"
            )
        return self._put(adapter), salt

    def unload(self, name: str, num_requests: NumRequests) -> None:
        """Takes adapter ``name`` out; LoraInUse while requests run under it,
        LoraNotLoaded when no adapter has that name."""
        if name not in self.names:
            raise LoraNotLoaded(f"lora_name: {name!r} is not loaded; loaded: {sorted(self.names)}")
        slot = self.resident.get(name)
        running = num_requests(slot) if slot is not None else 0
        if running:
            raise LoraInUse(
                f"lora_name: {name!r} has {running} requests in flight; unload it once they end"
            )
        self._forget(name)
        del self.paths[name]

    def _make_room(self, num_requests: NumRequests) -> bool:
        """Whether one more adapter fits in memory, once the least recently used one
        without requests is taken out if need be."""
        if self.max_resident is None or len(self.resident) < self.max_resident:
            return True
        for name, slot in self.resident.items():
            if not num_requests(slot):
                self._take_out(name)
                return True
        return False

    def _put(self, adapter: LoraAdapter) -> int:
        """Puts ``adapter`` in a free slot (the lowest freed one, else a new one)."""
        if self._free:
            slot = self._free.pop(0)
        else:
            slot, self._num_slots = self._num_slots, self._num_slots + 1
        put_adapter(self.model, slot, adapter)
        path = str(self.paths[adapter.name].absolute())
        self._mirror(LoraChange(slot, adapter.name, path, adapter.salt))
        self.resident[adapter.name] = slot
        self._publish(adapter.name, slot, adapter.salt)
        return slot

    def _take_out(self, name: str) -> None:
        slot = self.resident.pop(name)
        put_adapter(self.model, slot, None)
        self._mirror(LoraChange(slot, None))
        self._free = sorted([*self._free, slot])
        self._publish(name, -1, self.names[name][1])

    def _forget(self, name: str) -> None:
        if name in self.resident:
            self._take_out(name)
        self.names = {k: v for k, v in self.names.items() if k != name}

    def _mirror(self, change: LoraChange) -> None:
        """Queues ``change`` for the other ranks of a split model (rank 0's, after start)."""
        if self._mirrored:
            step = self.model.lora_step
            assert isinstance(step, LoraStep)
            step.changes.append(change)

    def _publish(self, name: str, slot: int, salt: int) -> None:
        self.names = {**self.names, name: (slot, salt)}

    def read(self, name: str, path: str | Path) -> LoraAdapter:
        """Adapter ``name`` read from ``path`` and checked against the model (its part, on
        a tensor-parallel rank); changes nothing here, so another thread may read one
        while the engine steps."""
        with self._reads_lock:  # read() runs on another thread too (serving.lora_calls)
            self.num_reads += 1
        adapter = load_adapter(name, path, self.shapes, self.num_layers, self.max_rank, self.device)
        if self.shard is not None and self.shard.size > 1:
            adapter = shard_adapter(adapter, self.config, self.shard)
        return adapter

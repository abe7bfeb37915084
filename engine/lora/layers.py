"""Adapters applied in a Llama-3 model: each adapted projection gains, per token group of
the step, its adapter's delta (``ops.lora_delta``). Tandem's fused projections (q/k/v,
gate/up) take each part's delta into that part's columns.

``use_lora`` swaps ``LoraLinear`` in for every projection an adapter targets, sharing the
base weights, and returns the model's ``LoraStep``: the runner fills it with the step's
``lora_grouped_offsets`` and ``lora_ids`` before every forward. ``put_adapter`` puts one
adapter in (or takes it out) at run time.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import nn

from engine.lora.adapter import LoraAdapter, LoraWeights
from engine.lora.ops import DENSE_MAX_TOKENS, CpuSgmv, DenseLora, lora_delta, token_mask

# Tandem's projection -> (its part's HF name, the part's share of its output)
FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attn.o_proj": ("self_attn.o_proj",),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.down_proj": ("mlp.down_proj",),
}


class LoraChange(NamedTuple):
    """An adapter put in slot ``slot`` of rank 0's model after start (``name``, read from
    ``path``, its files' digest ``salt``), or taken out of it (``name`` None): what the
    other tensor-parallel ranks do to theirs before their next forward."""

    slot: int
    name: str | None
    path: str = ""
    salt: int = 0


@dataclass
class LoraStep:
    """One step's token groups, each under one adapter slot (-1: none), as the seed names
    them; ``set`` before each forward. What the step's projections share is made once,
    at the first that asks, and dropped by the next ``set``."""

    lora_grouped_offsets: list[int] = field(default_factory=list)  # [G + 1]
    lora_ids: list[int] = field(default_factory=list)  # [G]
    is_active: bool = field(init=False, default=False)  # some group runs under an adapter
    # Rank 0's adapter changes since its last forward, for the other ranks (a split model's)
    changes: list[LoraChange] = field(default_factory=list)
    _made: dict[tuple[Any, ...], Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.is_active = any(i >= 0 for i in self.lora_ids)

    def set(self, offsets: list[int], ids: list[int]) -> None:
        self.lora_grouped_offsets, self.lora_ids = offsets, ids
        self.is_active = any(i >= 0 for i in ids)
        self._made = {}

    def take_changes(self) -> list[LoraChange]:
        """``changes``, emptied: each slot's last only (an adapter put in and taken out,
        or replaced, before a forward is never read by the other ranks)."""
        last = {change.slot: change for change in self.changes}
        self.changes = []
        return list(last.values())

    def device_groups(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The groups as SGMV takes them (kernels.reference.lora), on ``device``: offsets
        and ids as int32 tensors, and the longest group's tokens."""
        key = ("groups", device)
        if key not in self._made:
            offsets = self.lora_grouped_offsets
            longest = max((e - s for s, e in itertools.pairwise(offsets)), default=0)
            self._made[key] = (
                torch.tensor(offsets, dtype=torch.int32, device=device),
                torch.tensor(self.lora_ids, dtype=torch.int32, device=device),
                longest,
            )
        groups: tuple[torch.Tensor, torch.Tensor, int] = self._made[key]
        return groups

    def column_mask(self, dense: DenseLora) -> torch.Tensor:
        """``dense.column_mask`` of this step's ``mask``, made once for each set of ranks
        (the projections of a model share a few)."""
        key = ("columns", dense.num_slots, dense.a.device, tuple(dense.ranks))
        if key not in self._made:
            self._made[key] = dense.column_mask(self.mask(dense.num_slots, dense.a.device))
        mask: torch.Tensor = self._made[key]
        return mask

    def mask(self, num_slots: int, device: torch.device) -> torch.Tensor:
        """``token_mask`` of this step's groups."""
        key = ("mask", num_slots, device)
        if key not in self._made:
            self._made[key] = token_mask(
                self.lora_grouped_offsets, self.lora_ids, num_slots, device
            )
        mask: torch.Tensor = self._made[key]
        return mask


class LoraLinear(nn.Module):
    """``base`` plus each token group's adapter delta, part by part (``parts``: the
    output widths of its parts, as ``FUSED`` names them; ``weights[p][slot]``: part p's
    weights in the adapter in ``slot``, or None)."""

    def __init__(
        self,
        base: nn.Module,
        parts: Sequence[int],
        weights: list[list[LoraWeights | None]],
        step: LoraStep,
    ) -> None:
        super().__init__()
        self.base, self.parts, self.weights, self.step = base, list(parts), weights, step
        self.dense: DenseLora | None = None  # made at its first step that needs it after
        self.sgmv: CpuSgmv | None = None  # a change of adapters (put_adapter)
        self.key = next(_KEYS)  # in _LINEARS, for the op compiled graphs call
        _LINEARS[self.key] = self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.base(x)
        if torch.compiler.is_compiling():  # the deltas as one opaque op of the graph
            out: torch.Tensor = torch.ops.tandem.lora_deltas(y, x, self.key)
            return out
        return self.with_deltas(y, x)

    def with_deltas(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``y`` (the base's product of ``x``) plus the step's deltas; ``y`` itself,
        changed in place, or a new tensor."""
        step = self.step
        if not step.is_active:
            return y
        x2 = x.reshape(-1, x.shape[-1])
        if step.lora_grouped_offsets[-1] != x2.shape[0]:  # groups of another forward
            raise RuntimeError(
                f"lora: the step's groups cover {step.lora_grouped_offsets[-1]} tokens, "
                f"the forward has {x2.shape[0]}"
            )
        if x2.is_cuda:  # the GPU path: Triton's SGMV kernels, whatever the tokens
            from kernels.triton import lora as sgmv

            delta = self._dense(x2).segmented(x2, step.device_groups(x2.device), sgmv)
        elif y.dtype == x2.dtype and (cpu := self._sgmv(x2)) is not None:  # CPU, in place
            y2 = y.view(-1, y.shape[-1])
            cpu.add_deltas(y2, x2, step.lora_grouped_offsets, step.lora_ids)
            return y
        elif x2.shape[0] <= DENSE_MAX_TOKENS:  # no kernels: aten, masked or per group
            dense = self._dense(x2)
            y2 = y.view(-1, y.shape[-1])
            dense.add_deltas(y2, x2, step.column_mask(dense))
            return y
        else:
            delta = torch.cat(
                [
                    lora_delta(x2, step.lora_grouped_offsets, step.lora_ids, by_id, width)
                    for by_id, width in zip(self.weights, self.parts, strict=True)
                ],
                dim=-1,
            )
        return y + delta.view(y.shape).to(y.dtype)

    def _sgmv(self, x: torch.Tensor) -> CpuSgmv | None:
        """The adapters in the CPU kernel's layout, for ``x``'s dtype (made again after
        ``put_adapter`` changed them); None where the kernel does not run ``x``."""
        if self.sgmv is None or self.sgmv.dtype != x.dtype:
            if not CpuSgmv.applies(x):
                return None
            self.sgmv = CpuSgmv(self.weights, x.shape[-1], self.parts, x.dtype)
        return self.sgmv

    def _dense(self, x: torch.Tensor) -> DenseLora:
        """The adapters stacked, made again after ``put_adapter`` changed them."""
        if self.dense is None:
            self.dense = DenseLora(self.weights, x.shape[-1], self.parts, x.device)
        return self.dense


# Every LoraLinear of this process, by key: a compiled graph calls the op below with a
# projection's key (Python code inside the graph, not traced: a step's groups change what
# it runs, which a graph without guards on its modules would have fixed at its capture).
_LINEARS: weakref.WeakValueDictionary[int, LoraLinear] = weakref.WeakValueDictionary()
_KEYS = itertools.count(1)


@torch.library.custom_op("tandem::lora_deltas", mutates_args=())
def _lora_deltas_op(y: torch.Tensor, x: torch.Tensor, key: int) -> torch.Tensor:
    return _LINEARS[key].with_deltas(y.clone(), x)


@_lora_deltas_op.register_fake
def _(y: torch.Tensor, x: torch.Tensor, key: int) -> torch.Tensor:
    return torch.empty_like(y)


def use_lora(
    model: nn.Module, adapters: Sequence[LoraAdapter], *, every_projection: bool = False
) -> LoraStep:
    """Swaps ``LoraLinear`` in for every projection of ``model`` (a Llama-3, one device)
    that one of ``adapters`` targets (``every_projection``: all of them, so that adapters
    put in later change no module: what a compiled model needs); adapter i is ``lora_ids``
    i. With none, the model has its ``LoraStep`` (``put_adapter`` adds the rest)."""
    step = LoraStep()
    model.lora_step = step  # type: ignore[assignment]
    if every_projection:
        put_adapter(model, -1, None, wrap=True)
    for i, adapter in enumerate(adapters):
        put_adapter(model, i, adapter)
    return step


def put_adapter(
    model: nn.Module, adapter_id: int, adapter: LoraAdapter | None, *, wrap: bool = False
) -> None:
    """Puts ``adapter``'s weights at ``lora_ids`` ``adapter_id`` in every projection of
    ``model`` (after ``use_lora``), swapping ``LoraLinear`` in for those it targets first
    (``wrap``: for every projection); None takes an adapter's weights out (unloaded); id
    -1 puts nothing. Between steps only."""
    step = model.lora_step
    assert isinstance(step, LoraStep)
    layers = model.layers
    assert isinstance(layers, nn.ModuleList)
    for i, layer in enumerate(layers):
        for ours, parts in FUSED.items():
            names = [f"model.layers.{i}.{part}" for part in parts]
            new = [adapter.modules.get(name) if adapter else None for name in names]
            owner_name, attr = ours.split(".")
            owner = getattr(layer, owner_name)
            linear = getattr(owner, attr)
            if not isinstance(linear, LoraLinear):
                if not any(new) and not wrap:
                    continue
                empty: list[list[LoraWeights | None]] = [[] for _ in parts]
                linear = LoraLinear(linear, _widths(owner, attr), empty, step)
                setattr(owner, attr, linear)
            if adapter_id < 0:
                continue
            for by_id, weights in zip(linear.weights, new, strict=True):
                by_id.extend([None] * (adapter_id + 1 - len(by_id)))
                by_id[adapter_id] = weights
            linear.dense = linear.sgmv = None  # stacked again at its next step


def _widths(owner: nn.Module, attr: str) -> list[int]:
    """The output widths of projection ``attr``'s parts: q, k and v; gate and up; or one."""
    if attr == "qkv_proj":
        return [owner.q_size, owner.kv_size, owner.kv_size]  # type: ignore[list-item]
    if attr == "gate_up_proj":
        return [owner.intermediate_size] * 2  # type: ignore[list-item]
    return [getattr(owner, attr).out_features]

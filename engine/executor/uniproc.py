"""The target's forward in this process, on this device: today's path behind the seam."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn

from engine.attention.base import AttentionBackend
from engine.executor import data_parallel
from engine.executor.gathered_kv import GatheredKv
from engine.executor.graph_steps import NO_PEERS, GraphPeers
from engine.executor.inputs import ForwardInputs, TargetForward
from engine.kv_cache import PagedKVCache
from engine.models.llama3 import ModelOutputs, ReturnHiddenStates

# Graphs one engine's compiled decode forward may hold (dynamo's default is 8).
DECODE_RECOMPILE_LIMIT = 32


def compile_decode_model(
    model: nn.Module, kv_cache: PagedKVCache, *, cpp_wrapper: bool = False
) -> nn.Module:
    """torch.compile of ``model`` with dynamic shapes, for decode steps (batch size and
    context length are symbolic: a graph for one row and one for several, not one per
    shape). On CPU inductor fuses the ~40 small ops per layer around the matrix products
    into a few kernels; that is most of a batch-1 step's time. Split over ranks, each
    rank compiles its own shard, with the collectives as ops of its graphs
    (``engine.parallel.group``).

    - size_asserts off: inductor's wrapper otherwise checks the size and stride of about
      280 buffers on every call, a tenth of a batch-1 step (bench/RESULTS.md). No guards
      on the modules' attributes either: the model is fixed once loaded, and checking them
      costs a tenth of a batch-1 step too. Only for a model whose forward traces as one
      graph (``traces_whole``): where it breaks (DeepSeek-V3's experts, chosen per step),
      dynamo compiles the modules called from the break one frame at a time, every
      ``Linear`` from one code object, and without guards on them the graph of one
      projection ran for another of another shape.
    - Graphs are this engine's own (dynamo otherwise keys them on the code of ``forward``,
      shared by every model in the process) and up to DECODE_RECOMPILE_LIMIT of them:
      speculative verification adds graphs per tapped layers and per 1 or several tokens
      and rows. Past the limit dynamo runs the forward eagerly without a word; with
      dynamo's default of 8 shared by every engine, the speculative engines of a
      benchmark process ran eagerly.
    - ``cpp_wrapper``: inductor's C++ wrapper calls the graph's kernels instead of its
      Python one: SmolLM2's Q4_1 file at batch 1 went from 0.80x to 0.94x of llama-bench
      at one thread, but compiling from a cold cache takes 4-5x as long
      (bench/RESULTS.md). Off by default.
    - The KV pools and the modules' own tensors (packed weight panels, rope tables) keep
      their shapes for the engine's life: static, not symbols. As symbols (dynamic=True
      makes every input's sizes one), the shape guards on their sizes and strides take
      most of a warm-up's compile time (bench/RESULTS.md).
    """
    fixed = [pool for layer in kv_cache.layers for pool in layer]
    fixed += [
        value
        for module in model.modules()
        for value in vars(module).values()
        if isinstance(value, torch.Tensor)
    ]
    for tensor in fixed:
        torch._dynamo.mark_static(tensor)
        if tensor._base is not None:  # a view (the panels): its base is an input too
            torch._dynamo.mark_static(tensor._base)
    options: dict[str, Any] = {"size_asserts": False, "cpp_wrapper": cpp_wrapper}
    if getattr(model, "traces_whole", False):
        options["guard_filter_fn"] = torch.compiler.skip_guard_on_all_nn_modules_unsafe
    compiled: nn.Module = torch.compile(  # type: ignore[call-overload]
        model,
        dynamic=True,
        isolate_recompiles=True,
        recompile_limit=DECODE_RECOMPILE_LIMIT,
        options=options,
    )
    return compiled


class UniprocExecutor:
    """Runs a target forward (``forward``) over this process's model and KV pools: the
    eager ``model``, or ``decode_model`` (its compiled form, where compiled) for decode
    steps. ``MultiprocExecutor`` runs the same on every rank."""

    def __init__(
        self,
        model: nn.Module,
        kv_cache: PagedKVCache,
        backend: AttentionBackend,
        decode_model: nn.Module | None = None,
    ) -> None:
        self.model = model
        self.decode_model = decode_model if decode_model is not None else model
        self.kv_cache = kv_cache
        self.backend = backend
        # What the graph runner tells the other ranks of its steps: none here.
        self.graph_peers: GraphPeers = NO_PEERS
        # Pools split over ranks that share no memory, by name (engine.executor.gathered_kv):
        # none here, where the pools are whole.
        self.gathered: dict[str, GatheredKv] = {}

    def gathers(self, pool: str) -> bool:
        """Whether ``pool``'s KV heads must be gathered to rank 0's copy after a write
        (``gather_kv``) and spread from it after a transfer lands there (``scatter_kv``)."""
        return pool in self.gathered

    def gather_kv(self, pool: str, slots: torch.Tensor) -> None:
        """Every rank's heads of ``pool`` at ``slots`` into rank 0's whole copy."""
        self.gathered[pool].gather(slots)

    def scatter_kv(self, pool: str, blocks: torch.Tensor) -> None:
        """Rank 0's whole copy of ``pool``'s ``blocks`` into each rank's heads."""
        self.gathered[pool].scatter(blocks)

    @torch.inference_mode()
    def forward(self, inputs: ForwardInputs, *, compiled: bool = False) -> ModelOutputs:
        dp = getattr(self.model, "dp", None)
        if inputs.dp_ranks is not None and dp is not None:  # this rank's rows only
            idle = cast(Callable[[ReturnHiddenStates], ModelOutputs], self.model.idle_pass)
            rows = functools.partial(self._forward_rows, compiled=compiled)
            return data_parallel.forward(inputs, dp, rows, idle)
        return self._forward_rows(inputs, compiled=compiled)

    def _forward_rows(self, inputs: ForwardInputs, *, compiled: bool = False) -> ModelOutputs:
        metadata = inputs.metadata
        if metadata is None:
            metadata = self.backend.build_metadata(inputs.layout)
        model = self.decode_model if compiled else self.model
        out: ModelOutputs = model(
            inputs.tokens,
            inputs.layout.positions,
            self.kv_cache.layers,
            self.backend,
            metadata,
            inputs.logit_indices,
            inputs.return_hidden_states,
            inputs.on_layer,
        )
        return out

    def compiled_forward(self) -> TargetForward:
        """What speculative verification calls: ``forward`` through the compiled model."""
        return functools.partial(self.forward, compiled=True)

    def on_rank_lost(self, fn: Callable[[str], None]) -> None:
        """``fn(why)`` runs (on a thread of its own) if a rank's process ends: never, here."""

    def abandon(self) -> None:
        """Kills the other ranks at once (a process about to exit): none, here."""

    def close(self) -> None:
        """Nothing to stop in this process."""

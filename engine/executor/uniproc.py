"""The target's forward in this process, on this device: today's path behind the seam."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn

from engine.attention.base import AttentionBackend
from engine.executor.inputs import ForwardInputs, TargetForward
from engine.kv_cache import PagedKVCache
from engine.models.llama3 import ModelOutputs


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

    @property
    def num_ranks(self) -> int:
        return 1

    @torch.inference_mode()
    def forward(self, inputs: ForwardInputs, *, compiled: bool = False) -> ModelOutputs:
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

    def close(self) -> None:
        """Nothing to stop in this process."""

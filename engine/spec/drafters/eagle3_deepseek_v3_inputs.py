"""The seed's inputs of an EAGLE-3 draft forward beside a DeepSeek-V3 target, on one device.

``Eagle3DeepseekV3Inputs`` (the MLA draft) and ``Eagle3MHADeepseekV3Inputs`` (the MHA draft)
keep the seed's field names and meanings. Fields for several devices, LoRA and expert
parallelism keep their place and stay empty: a draft runs on one device (rank 0 of a
split target).

A DeepSeek-V3 draft builds its inputs when it extends (the verify width 1+K in a unified
step, a prompt chunk's width at prefill) and dispatches every forward of the step through
them: the attention metadata of each width its ``kv_cache_inputs`` declares, the extend's
borrowed from the target (one block table, one layout of rows) and the chain's (one token
per row) built per forward. The MLA draft's pools have the target's latent layout; the MHA
draft's are its own K and V, apart from the target's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import KW_ONLY, dataclass
from typing import Any, Self

import torch

from engine.attention.base import AttentionBackend, BatchLayout


@dataclass
class KVCacheInputs:
    """One cache as a forward reads it: its pools, the rows' block tables and lengths, and
    the attention dispatch of each query width a step runs at."""

    kv_blocks: Sequence[tuple[torch.Tensor, ...]]  # per layer its pools: (latent,) or (k, v)
    lookup_table: torch.Tensor  # [B, M] int64 block ids per row (shared with the target)
    cache_lengths: torch.Tensor  # [B] int64 KV length of each row after the extend
    max_lengths: torch.Tensor  # [W, 2] int64 CPU: (q_max_seq_len, max cache length) per width
    # Per row of max_lengths: the backend's metadata prepared for that width, or None where
    # each forward at that width builds its own (the chain: positions move every step).
    attention_dispatch_metadata: list[Any]

    @property
    def widths(self) -> list[int]:
        """The query widths (``q_max_seq_len``) this cache is dispatched at."""
        return [int(w) for w in self.max_lengths[:, 0].tolist()]

    def dispatch(self, layout: BatchLayout, backend: AttentionBackend) -> Any:
        """The metadata a forward of ``layout`` attends with: the prepared one of its width,
        else the backend's for it; a width none of ``max_lengths`` declares is refused."""
        widths = self.widths
        if layout.max_query_len not in widths:
            raise ValueError(
                f"q_max_seq_len: {layout.max_query_len}, the draft's cache inputs dispatch "
                f"widths {widths}"
            )
        prepared = self.attention_dispatch_metadata[widths.index(layout.max_query_len)]
        return prepared if prepared is not None else backend.build_metadata(layout)


@dataclass
class Eagle3DeepseekV3Inputs:
    """Inputs of the MLA EAGLE-3 draft's forwards in one step (the seed's names)."""

    tokens: torch.Tensor  # [T] int64: the token after each extended position
    input_row_offsets: torch.Tensor  # [B+1] int64, device
    signal_buffers: list[torch.Tensor]  # cross-device all-reduce scratch: none on one device
    host_input_row_offsets: torch.Tensor  # [B+1] int64, CPU
    batch_context_lengths: list[torch.Tensor]  # per device [1] int64: the rows' KV tokens
    draft_tokens: torch.Tensor | None = None  # [B, K] int64 once proposed
    draft_kv_blocks: list[Sequence[tuple[torch.Tensor, ...]]] | None = None  # per device
    # Per-row sampling of the acceptance sampler ([B], device; max_k, min_top_p 0-d CPU):
    # the unified step holds them (SamplingTensors); a draft forward does not read them.
    seed: torch.Tensor | None = None
    temperature: torch.Tensor | None = None
    top_k: torch.Tensor | None = None
    max_k: torch.Tensor | None = None
    top_p: torch.Tensor | None = None
    min_top_p: torch.Tensor | None = None
    in_thinking_phase: torch.Tensor | None = None  # [B] bool
    pinned_bitmask: torch.Tensor | None = None  # [B, K+1, ceil(V/32)] structured output
    wait_payload: torch.Tensor | None = None  # the seed's in-graph host wait: none here
    device_bitmask_scratch: torch.Tensor | None = None
    _: KW_ONLY
    kv_cache_inputs: KVCacheInputs | None = None  # what the draft's attention dispatches by
    lora: None = None  # no LoRA adapters
    hidden_states: torch.Tensor | list[torch.Tensor] | None = None  # [T, 3H] target features
    return_n_logits: torch.Tensor  # [1] int64: logits per row (the draft scores one)
    data_parallel_splits: torch.Tensor  # [2] int64: rows 0..B on the one replica
    ep_inputs: tuple[torch.Tensor, ...] = ()  # expert parallelism: none

    @property
    def buffers(self) -> tuple[torch.Tensor, ...]:
        """The positional tensors, in the seed's order (those that are set)."""
        named = (
            self.tokens,
            self.input_row_offsets,
            self.host_input_row_offsets,
            self.return_n_logits,
            self.data_parallel_splits,
            *self.signal_buffers,
            *self.batch_context_lengths,
            *self.ep_inputs,
        )
        optional = (
            self.draft_tokens,
            self.seed,
            self.temperature,
            self.top_k,
            self.max_k,
            self.top_p,
            self.min_top_p,
            self.pinned_bitmask,
            self.wait_payload,
            self.device_bitmask_scratch,
        )
        return named + tuple(t for t in optional if t is not None)

    @classmethod
    def for_extend(
        cls,
        tokens: torch.Tensor,  # [T] int64
        features: torch.Tensor,  # [T, 3H]
        layout: BatchLayout,
        metadata: Any,  # the target's metadata for ``layout``
        kv: Sequence[tuple[torch.Tensor, ...]],  # the draft's pools
    ) -> Self:
        """The step's inputs from the extend's: the draft borrows the target's dispatch at the
        extend's width, and builds the chain's (width 1) per forward. An extend of width 1
        (every row one token: a prompt's last chunk of one) shares its width with the
        chain, whose forwards sit at other positions: then both build their own."""
        widths = dispatch_widths(layout)
        borrowed = metadata if layout.max_query_len > 1 else None
        cache = KVCacheInputs(
            kv_blocks=kv,
            lookup_table=layout.block_tables,
            cache_lengths=layout.context_lens,
            max_lengths=widths,
            # The extend's width: the target's metadata; the chain's: built per forward.
            attention_dispatch_metadata=[borrowed, None][: len(widths)],
        )
        return cls(
            tokens,
            layout.input_row_offsets,
            [],
            host_row_offsets(layout),
            [layout.context_lens.sum().reshape(1)],
            draft_kv_blocks=[kv],
            kv_cache_inputs=cache,
            hidden_states=features,
            return_n_logits=torch.ones(1, dtype=torch.int64),
            data_parallel_splits=torch.tensor([0, layout.block_tables.shape[0]]),
        )


@dataclass
class Eagle3MHADeepseekV3Inputs(Eagle3DeepseekV3Inputs):
    """Inputs of the MHA EAGLE-3 draft's forwards in one step: the draft owns its
    ``KVCacheInputs`` (its K/V pools, apart from the target's latent ones), dispatched at
    the extend's width (1 + K when verifying) and at the chain's (1). ``lookup_table`` and
    ``cache_lengths`` are the target's: one block id names a target and a draft block."""


def dispatch_widths(layout: BatchLayout) -> torch.Tensor:
    """[W, 2] CPU: the extend's (q_max_seq_len, max cache length), then the chain's width 1
    (whose cache reaches as far: ``max_context_len`` bounds every forward of the step)."""
    rows = [[layout.max_query_len, layout.max_context_len]]
    if layout.max_query_len > 1:
        rows.append([1, layout.max_context_len])
    return torch.tensor(rows, dtype=torch.int64)


def host_row_offsets(layout: BatchLayout) -> torch.Tensor:
    """[B+1] CPU row offsets, known on the host without a device read: from the rows'
    query lengths where the layout has them (prefill), else uniform (verify, chain)."""
    if layout.query_lens is not None:
        return torch.tensor([0, *layout.query_lens], dtype=torch.int64).cumsum(0)
    num_rows = layout.block_tables.shape[0]
    return torch.arange(num_rows + 1, dtype=torch.int64) * layout.max_query_len

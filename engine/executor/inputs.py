"""One target forward's inputs (``ForwardInputs``), and their form on the wire between
ranks: one int64 tensor (``encode``, ``decode``), nothing pickled.

Every rank runs the same forward over its own shard and KV pools: the tokens, the
batch's layout (positions, KV slots, block tables, context lengths) and which tokens get
logits. Each rank builds its attention backend's metadata from the layout itself.

The graph runner's steps, and a split draft's forwards, travel otherwise: their shapes
in a message, their tensors as broadcasts on the device (``engine.executor.graph_wire``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from engine.attention.base import BatchLayout
from engine.models.llama3 import NO_HIDDEN_STATES, ModelOutputs, ReturnHiddenStates

MESSAGE_FORMAT = 6  # bumped whenever the layout below changes
OP_FORWARD, OP_STOP, OP_GRAPH_DEFINE, OP_GRAPH_RUN, OP_KV = 1, 2, 3, 4, 5
KV_POOLS = ("target", "draft")  # what an OP_KV message names, by index


@dataclass
class ForwardInputs:
    tokens: torch.Tensor  # [T] int64
    layout: BatchLayout
    logit_indices: torch.Tensor  # [N] int64: which of the T tokens get logits
    return_hidden_states: ReturnHiddenStates = NO_HIDDEN_STATES
    metadata: Any = None  # the backend's, from ``layout``; None: built by the executor
    on_layer: Callable[[int], None] | None = None  # told once layer i wrote its KV
    # Data-parallel attention: each row's rank ([B] int64); each rank runs its rows only.
    dp_ranks: torch.Tensor | None = None


# A forward's LoRA token groups (engine.lora.layers.LoraStep): lora_grouped_offsets, lora_ids
LoraGroups = tuple[list[int], list[int]]
# Rank 0's adapter changes before a forward (engine.lora.layers.LoraChange): slot, name
# (None: taken out), path, digest
LoraChanges = Sequence[tuple[int, str | None, str, int]]

# What speculative steps call for their verification: the compiled forward, where compiled.
TargetForward = Callable[[ForwardInputs], ModelOutputs]


class _Writer:
    def __init__(self) -> None:
        self.parts: list[torch.Tensor] = []

    def ints(self, *values: int) -> None:
        self.parts.append(torch.tensor(values, dtype=torch.int64))

    def tensor(self, x: torch.Tensor) -> None:
        """Its shape, then its values (int64, on the host)."""
        self.ints(x.dim(), *x.shape)
        self.parts.append(x.detach().reshape(-1).to("cpu", torch.int64))

    def optional(self, values: list[int] | None) -> None:
        if values is None:
            self.ints(-1)
        else:
            self.ints(len(values), *values)


class _Reader:
    def __init__(self, message: torch.Tensor) -> None:
        self.values = message
        self.at = 0

    def ints(self, n: int) -> list[int]:
        got = self.values[self.at : self.at + n].tolist()
        self.at += n
        return got

    def tensor(self, device: torch.device) -> torch.Tensor:
        (ndim,) = self.ints(1)
        shape = self.ints(ndim)
        numel = torch.Size(shape).numel()
        x = self.values[self.at : self.at + numel].view(shape)
        self.at += numel
        return x.to(device, copy=True)

    def optional(self) -> list[int] | None:
        (n,) = self.ints(1)
        return None if n < 0 else self.ints(n)


def encode(
    inputs: ForwardInputs,
    *,
    compiled: bool,
    lora_groups: LoraGroups | None = None,
    lora_changes: LoraChanges = (),
) -> torch.Tensor:
    """The message every other rank runs ``inputs`` from (``compiled``: through the compiled
    forward, as decode steps do; ``lora_groups``: rank 0's model's LoRA token groups for
    it, where it runs adapters; ``lora_changes``: the adapters rank 0 put in or took out
    since its last forward, names and paths as UTF-8 bytes)."""
    layout, hidden = inputs.layout, inputs.return_hidden_states
    w = _Writer()
    w.ints(MESSAGE_FORMAT, OP_FORWARD, compiled, inputs.on_layer is not None)
    w.ints(layout.block_size, layout.max_query_len, layout.max_context_len)
    w.ints(layout.is_causal_prefill, layout.is_causal, layout.is_max_context_exact, hidden.final)
    for x in forward_tensors(inputs):
        w.tensor(x)
    w.optional(list(hidden.layer_ids))
    w.optional(layout.query_lens)
    w.optional(layout.context_lens_host)
    w.optional(None if inputs.dp_ranks is None else inputs.dp_ranks.tolist())
    w.optional(None if lora_groups is None else lora_groups[0])
    w.optional(None if lora_groups is None else lora_groups[1])
    w.ints(len(lora_changes))
    for slot, name, path, salt in lora_changes:
        w.ints(slot, salt)
        w.optional(None if name is None else list(name.encode()))
        w.optional(list(path.encode()))
    return torch.cat(w.parts)


def forward_tensors(inputs: ForwardInputs) -> list[torch.Tensor]:
    """A forward's tensors, in the order they travel (all int64); ``assemble`` undoes it."""
    layout = inputs.layout
    return [
        inputs.tokens,
        inputs.logit_indices,
        layout.input_row_offsets,
        layout.positions,
        layout.slot_mapping,
        layout.context_lens,
        layout.block_tables,
    ]


def assemble(
    tensors: Sequence[torch.Tensor],  # forward_tensors' order
    bounds: tuple[int, int, int],  # block_size, max_query_len, max_context_len
    flags: Sequence[int | bool],  # is_causal_prefill, is_causal, is_max_context_exact
    hidden: ReturnHiddenStates,
    query_lens: list[int] | None = None,
    context_lens_host: list[int] | None = None,
    dp_ranks: torch.Tensor | None = None,
) -> ForwardInputs:
    """The forward of ``tensors`` and its host fields, on the receiving rank."""
    tokens, logit_indices, offsets, positions, slots, context_lens, tables = tensors
    block_size, max_query_len, max_context_len = bounds
    causal_prefill, causal, exact = flags
    layout = BatchLayout(
        input_row_offsets=offsets,
        positions=positions,
        slot_mapping=slots,
        context_lens=context_lens,
        block_tables=tables,
        block_size=block_size,
        max_query_len=max_query_len,
        max_context_len=max_context_len,
        is_causal_prefill=bool(causal_prefill),
        is_causal=bool(causal),
        is_max_context_exact=bool(exact),
        query_lens=query_lens,
        context_lens_host=context_lens_host,
    )
    return ForwardInputs(tokens, layout, logit_indices, hidden, dp_ranks=dp_ranks)


def stop_message() -> torch.Tensor:
    return torch.tensor([MESSAGE_FORMAT, OP_STOP], dtype=torch.int64)


@dataclass(frozen=True)
class KvMove:
    """Rank 0's word to join a move of a pool's KV heads between rank 0's whole copy and
    the ranks' pools (engine.executor.gathered_kv): a gather of ``indices`` as slots, or a
    scatter of them as blocks."""

    pool: str  # "target" or "draft"
    is_scatter: bool
    indices: torch.Tensor  # [n] int64, on the host

    def encode(self) -> torch.Tensor:
        head = [MESSAGE_FORMAT, OP_KV, KV_POOLS.index(self.pool), self.is_scatter]
        return torch.cat([torch.tensor(head), self.indices.reshape(-1).to("cpu", torch.int64)])


@dataclass(frozen=True)
class ForwardStep:
    inputs: ForwardInputs
    compiled: bool  # through the compiled forward
    lora_groups: LoraGroups | None = None  # set on the rank's LoraStep before the forward
    lora_changes: LoraChanges = ()  # done to the rank's adapters before the forward


def message_op(message: torch.Tensor) -> int:
    """A message's op (``OP_*``), its format checked."""
    version, op = message[:2].tolist()
    if version != MESSAGE_FORMAT:
        raise ValueError(f"step message format {version}, this rank reads {MESSAGE_FORMAT}")
    return int(op)


def decode(message: torch.Tensor, device: torch.device) -> ForwardStep | KvMove | None:
    """``encode``'s forward (its inputs on ``device``), or a ``KvMove``; None for a stop.
    The graph runner's messages: ``engine.executor.graph_wire.decode_message``."""
    op = message_op(message)
    if op == OP_STOP:
        return None
    if op == OP_KV:
        pool, is_scatter = message[2:4].tolist()
        return KvMove(KV_POOLS[pool], bool(is_scatter), message[4:].clone())
    if op != OP_FORWARD:
        raise ValueError(f"step message: unknown op {op}")
    r = _Reader(message)
    r.ints(2)  # format and op, read above
    compiled, _ = r.ints(2)
    bounds = r.ints(3)
    *flags, final = r.ints(4)
    tensors = [r.tensor(device) for _ in range(7)]
    hidden = ReturnHiddenStates(tuple(r.optional() or []), bool(final))
    query_lens, context_lens_host, ranks = r.optional(), r.optional(), r.optional()
    lora_offsets, lora_ids = r.optional(), r.optional()
    lora_groups = None if lora_offsets is None else (lora_offsets, lora_ids or [])
    lora_changes = []
    for _ in range(r.ints(1)[0]):
        slot, salt = r.ints(2)
        name, path = r.optional(), r.optional() or []
        text = None if name is None else bytes(name).decode()
        lora_changes.append((slot, text, bytes(path).decode(), salt))
    dp_ranks = None if ranks is None else torch.tensor(ranks, dtype=torch.int64, device=device)
    inputs = assemble(
        tensors, (bounds[0], bounds[1], bounds[2]), flags, hidden,
        query_lens, context_lens_host, dp_ranks,
    )  # fmt: skip
    return ForwardStep(inputs, bool(compiled), lora_groups, lora_changes)

"""One target forward's inputs (``ForwardInputs``), and their form on the wire between
ranks: one int64 tensor (``encode``, ``decode``), nothing pickled.

Every rank runs the same forward over its own shard and KV pools: the tokens, the
batch's layout (positions, KV slots, block tables, context lengths) and which tokens get
logits. Each rank builds its attention backend's metadata from the layout itself.

The graph runner's steps (``engine.spec.graph_runner``) send their forwards in two parts
instead, since a captured graph cannot read its tensors on the host: the message says
only what is fixed per graph (``GraphSignature``: the shapes and the host-side bounds),
once per graph (``encode_define``; then ``encode_run`` names it), and the tensors travel
on the device, inside the step, as one broadcast of ``pack``'s int64 buffer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from engine.attention.base import BatchLayout
from engine.models.llama3 import NO_HIDDEN_STATES, ModelOutputs, ReturnHiddenStates

MESSAGE_FORMAT = 3  # bumped whenever the layout below changes
OP_FORWARD, OP_STOP, OP_GRAPH_DEFINE, OP_GRAPH_RUN = 1, 2, 3, 4


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
        numel = _numel(tuple(shape))
        x = self.values[self.at : self.at + numel].view(shape)
        self.at += numel
        return x.to(device, copy=True)

    def optional(self) -> list[int] | None:
        (n,) = self.ints(1)
        return None if n < 0 else self.ints(n)


def encode(inputs: ForwardInputs, *, compiled: bool) -> torch.Tensor:
    """The message every other rank runs ``inputs`` from (``compiled``: through the compiled
    forward, as decode steps do)."""
    layout, hidden = inputs.layout, inputs.return_hidden_states
    w = _Writer()
    w.ints(MESSAGE_FORMAT, OP_FORWARD, compiled, inputs.on_layer is not None)
    w.ints(layout.block_size, layout.max_query_len, layout.max_context_len)
    w.ints(layout.is_causal_prefill, layout.is_causal, layout.is_max_context_exact, hidden.final)
    for x in (inputs.tokens, inputs.logit_indices, layout.input_row_offsets, layout.positions):
        w.tensor(x)
    for x in (layout.slot_mapping, layout.context_lens, layout.block_tables):
        w.tensor(x)
    w.optional(list(hidden.layer_ids))
    w.optional(layout.query_lens)
    w.optional(layout.context_lens_host)
    w.optional(None if inputs.dp_ranks is None else inputs.dp_ranks.tolist())
    return torch.cat(w.parts)


def stop_message() -> torch.Tensor:
    return torch.tensor([MESSAGE_FORMAT, OP_STOP], dtype=torch.int64)


@dataclass(frozen=True)
class ForwardStep:
    inputs: ForwardInputs
    compiled: bool  # through the compiled forward


@dataclass(frozen=True)
class GraphSignature:
    """What is fixed in a graph step's forward: everything but its tensors' values."""

    compiled: bool
    block_size: int
    max_query_len: int
    max_context_len: int
    flags: tuple[bool, bool, bool]  # the layout's is_causal_prefill, is_causal, exact
    hidden: ReturnHiddenStates
    shapes: tuple[tuple[int, ...], ...]  # GRAPH_TENSORS' shapes

    @classmethod
    def of(cls, inputs: ForwardInputs, *, compiled: bool) -> GraphSignature:
        layout = inputs.layout
        if layout.query_lens is not None or layout.context_lens_host is not None:
            raise ValueError("a graph step's layout has no host-side lengths")
        if inputs.on_layer is not None or inputs.dp_ranks is not None:
            raise ValueError("a graph step has no per-layer hook and no data-parallel rows")
        return cls(
            compiled,
            layout.block_size,
            layout.max_query_len,
            layout.max_context_len,
            (layout.is_causal_prefill, layout.is_causal, layout.is_max_context_exact),
            inputs.return_hidden_states,
            tuple(tuple(x.shape) for x in graph_tensors(inputs)),
        )

    @property
    def numel(self) -> int:
        return sum(_numel(shape) for shape in self.shapes)

    def inputs(self, packed: torch.Tensor) -> ForwardInputs:
        """The forward whose tensors are views of ``packed`` (``pack``'s layout)."""
        views, at = [], 0
        for shape in self.shapes:
            views.append(packed[at : at + _numel(shape)].view(shape))
            at += _numel(shape)
        tokens, logit_indices, offsets, positions, slots, context_lens, tables = views
        causal_prefill, causal, exact = self.flags
        layout = BatchLayout(
            input_row_offsets=offsets,
            positions=positions,
            slot_mapping=slots,
            context_lens=context_lens,
            block_tables=tables,
            block_size=self.block_size,
            max_query_len=self.max_query_len,
            max_context_len=self.max_context_len,
            is_causal_prefill=causal_prefill,
            is_causal=causal,
            is_max_context_exact=exact,
        )
        return ForwardInputs(tokens, layout, logit_indices, self.hidden)


@dataclass(frozen=True)
class GraphDefine:
    graph_id: int
    signature: GraphSignature
    capture: bool  # into a CUDA graph (its ranks capture together), else run once


@dataclass(frozen=True)
class GraphRun:
    graph_id: int


def graph_tensors(inputs: ForwardInputs) -> list[torch.Tensor]:
    """The tensors a graph step's forward sends, in ``pack``'s order (all int64)."""
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


def pack(inputs: ForwardInputs) -> torch.Tensor:
    """One int64 buffer of ``graph_tensors``, on their device (no host read)."""
    parts = graph_tensors(inputs)
    if any(x.dtype != torch.int64 for x in parts):
        raise ValueError(f"graph step tensors must be int64: {[x.dtype for x in parts]}")
    return torch.cat([x.reshape(-1) for x in parts])


def encode_define(graph_id: int, signature: GraphSignature, *, capture: bool) -> torch.Tensor:
    g = signature
    w = _Writer()
    w.ints(MESSAGE_FORMAT, OP_GRAPH_DEFINE, graph_id, capture, g.compiled)
    w.ints(g.block_size, g.max_query_len, g.max_context_len, *g.flags, g.hidden.final)
    w.optional(list(g.hidden.layer_ids))
    w.ints(len(g.shapes))
    for shape in g.shapes:
        w.ints(len(shape), *shape)
    return torch.cat(w.parts)


def encode_run(graph_id: int) -> torch.Tensor:
    return torch.tensor([MESSAGE_FORMAT, OP_GRAPH_RUN, graph_id], dtype=torch.int64)


def _numel(shape: tuple[int, ...]) -> int:
    numel = 1
    for n in shape:
        numel *= n
    return numel


def _decode_define(r: _Reader) -> GraphDefine:
    graph_id, capture, compiled = r.ints(3)
    block_size, max_query_len, max_context_len, *flags, final = r.ints(7)
    layer_ids = r.optional() or []
    (count,) = r.ints(1)
    shapes = []
    for _ in range(count):
        (ndim,) = r.ints(1)
        shapes.append(tuple(r.ints(ndim)))
    signature = GraphSignature(
        bool(compiled),
        block_size,
        max_query_len,
        max_context_len,
        (bool(flags[0]), bool(flags[1]), bool(flags[2])),
        ReturnHiddenStates(tuple(layer_ids), bool(final)),
        tuple(shapes),
    )
    return GraphDefine(graph_id, signature, bool(capture))


def decode(
    message: torch.Tensor, device: torch.device
) -> ForwardStep | GraphDefine | GraphRun | None:
    """What a message asks a rank to run (``encode``'s inputs on ``device``); None: stop."""
    r = _Reader(message)
    version, op = r.ints(2)
    if version != MESSAGE_FORMAT:
        raise ValueError(f"step message format {version}, this rank reads {MESSAGE_FORMAT}")
    if op == OP_STOP:
        return None
    if op == OP_GRAPH_DEFINE:
        return _decode_define(r)
    if op == OP_GRAPH_RUN:
        return GraphRun(r.ints(1)[0])
    if op != OP_FORWARD:
        raise ValueError(f"step message: unknown op {op}")
    compiled, _ = r.ints(2)
    block_size, max_query_len, max_context_len = r.ints(3)
    is_causal_prefill, is_causal, is_exact, final = r.ints(4)
    tokens, logit_indices, offsets, positions = (r.tensor(device) for _ in range(4))
    slots, context_lens, tables = (r.tensor(device) for _ in range(3))
    layer_ids = r.optional() or []
    layout = BatchLayout(
        input_row_offsets=offsets,
        positions=positions,
        slot_mapping=slots,
        context_lens=context_lens,
        block_tables=tables,
        block_size=block_size,
        max_query_len=max_query_len,
        max_context_len=max_context_len,
        is_causal_prefill=bool(is_causal_prefill),
        is_causal=bool(is_causal),
        is_max_context_exact=bool(is_exact),
        query_lens=r.optional(),
        context_lens_host=r.optional(),
    )
    hidden = ReturnHiddenStates(tuple(layer_ids), bool(final))
    ranks = r.optional()
    dp_ranks = None if ranks is None else torch.tensor(ranks, dtype=torch.int64, device=device)
    inputs = ForwardInputs(tokens, layout, logit_indices, hidden, dp_ranks=dp_ranks)
    return ForwardStep(inputs, bool(compiled))

"""What travels between ranks for the graph runner's steps and a split draft's forwards:
their shapes in a message (a signature, ``encode_define``, then a number,
``encode_run``), and their tensors as broadcasts from rank 0, on the device, where a
captured graph can hold them (``engine.executor.graph_steps``).

A signature holds what a graph fixes: shapes, dtypes and host-side bounds; two forwards of
one signature differ only in their tensors' values. Each kind has its number (``kind``),
its fields as integers (``to_ints``, ``from_ints``) and its broadcasts' buffers
(``buffers``). The target's forward is ``GraphSignature`` (its int64 tensors packed into
one buffer); a split draft's are in ``engine.spec.split_draft``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import ClassVar, Protocol

import torch

from engine.executor.inputs import (
    MESSAGE_FORMAT,
    OP_GRAPH_DEFINE,
    OP_GRAPH_RUN,
    ForwardInputs,
    ForwardStep,
    KvMove,
    assemble,
    decode,
    forward_tensors,
    message_op,
)
from engine.models.llama3 import ReturnHiddenStates

ONCE = -1  # a define's number for a forward run once and not kept
DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # floats a broadcast carries


def optional_ints(values: tuple[int, ...] | None) -> list[int]:
    return [-1] if values is None else [len(values), *values]


def take(it: Iterator[int], n: int) -> list[int]:
    return [next(it) for _ in range(n)]


def take_optional(it: Iterator[int]) -> tuple[int, ...] | None:
    n = next(it)
    return None if n < 0 else tuple(take(it, n))


def views(packed: torch.Tensor, shapes: tuple[tuple[int, ...], ...]) -> list[torch.Tensor]:
    """``packed``'s consecutive runs, one of each shape."""
    out, at = [], 0
    for shape in shapes:
        numel = torch.Size(shape).numel()
        out.append(packed[at : at + numel].view(shape))
        at += numel
    return out


def pack(parts: list[torch.Tensor]) -> torch.Tensor:
    """One int64 buffer of ``parts``, on their device (no host read)."""
    if any(x.dtype != torch.int64 for x in parts):
        raise ValueError(f"packed tensors must be int64: {[x.dtype for x in parts]}")
    return torch.cat([x.reshape(-1) for x in parts])


@dataclass(frozen=True)
class GraphSignature:
    """A target forward's (or an extend's layout's) fixed part: everything but its
    tensors' values, which are ``forward_tensors`` packed."""

    kind: ClassVar[int] = 0
    compiled: bool
    block_size: int
    max_query_len: int
    max_context_len: int
    flags: tuple[bool, bool, bool]  # the layout's is_causal_prefill, is_causal, exact
    hidden: ReturnHiddenStates
    shapes: tuple[tuple[int, ...], ...]  # forward_tensors' shapes
    query_lens: tuple[int, ...] | None = None  # the layout's host-side lengths, if any
    context_lens_host: tuple[int, ...] | None = None

    @classmethod
    def of(cls, inputs: ForwardInputs, *, compiled: bool) -> GraphSignature:
        layout = inputs.layout
        if inputs.on_layer is not None or inputs.dp_ranks is not None:
            raise ValueError("a graph step has no per-layer hook and no data-parallel rows")
        return cls(
            compiled,
            layout.block_size,
            layout.max_query_len,
            layout.max_context_len,
            (layout.is_causal_prefill, layout.is_causal, layout.is_max_context_exact),
            inputs.return_hidden_states,
            tuple(tuple(x.shape) for x in forward_tensors(inputs)),
            None if layout.query_lens is None else tuple(layout.query_lens),
            None if layout.context_lens_host is None else tuple(layout.context_lens_host),
        )

    def buffers(self, device: torch.device) -> list[torch.Tensor]:
        numel = sum(torch.Size(shape).numel() for shape in self.shapes)
        return [torch.zeros(numel, dtype=torch.int64, device=device)]

    def inputs(self, packed: torch.Tensor) -> ForwardInputs:
        """The forward whose tensors are views of ``packed``."""
        return assemble(
            views(packed, self.shapes),
            (self.block_size, self.max_query_len, self.max_context_len),
            self.flags,
            self.hidden,
            None if self.query_lens is None else list(self.query_lens),
            None if self.context_lens_host is None else list(self.context_lens_host),
        )

    def to_ints(self) -> list[int]:
        ints = [self.compiled, self.block_size, self.max_query_len, self.max_context_len]
        ints += [*self.flags, self.hidden.final, *optional_ints(self.hidden.layer_ids)]
        ints.append(len(self.shapes))
        for shape in self.shapes:
            ints += [len(shape), *shape]
        return ints + optional_ints(self.query_lens) + optional_ints(self.context_lens_host)

    @classmethod
    def from_ints(cls, it: Iterator[int]) -> GraphSignature:
        compiled, block_size, max_query_len, max_context_len = take(it, 4)
        causal_prefill, causal, exact, final = take(it, 4)
        layer_ids = take_optional(it) or ()
        shapes = tuple(tuple(take(it, next(it))) for _ in range(next(it)))
        return cls(
            bool(compiled),
            block_size,
            max_query_len,
            max_context_len,
            (bool(causal_prefill), bool(causal), bool(exact)),
            ReturnHiddenStates(layer_ids, bool(final)),
            shapes,
            take_optional(it),
            take_optional(it),
        )


class Signature(Protocol):
    """A kind of forward's fixed part (hashable: rank 0 keys its graphs on it)."""

    kind: ClassVar[int]

    def to_ints(self) -> list[int]: ...
    def buffers(self, device: torch.device) -> list[torch.Tensor]: ...


SignatureKinds = Mapping[int, Callable[[Iterator[int]], Signature]]  # kind -> from_ints
TARGET_KINDS: SignatureKinds = {GraphSignature.kind: GraphSignature.from_ints}


@dataclass(frozen=True)
class GraphDefine:
    graph_id: int  # ONCE: run once, not kept
    signature: Signature
    capture: bool  # into a CUDA graph (its ranks capture together), else run


@dataclass(frozen=True)
class GraphRun:
    graph_id: int


def encode_define(graph_id: int, signature: Signature, *, capture: bool) -> torch.Tensor:
    head = [MESSAGE_FORMAT, OP_GRAPH_DEFINE, graph_id, capture, signature.kind]
    return torch.tensor(head + signature.to_ints(), dtype=torch.int64)


def encode_run(graph_id: int) -> torch.Tensor:
    return torch.tensor([MESSAGE_FORMAT, OP_GRAPH_RUN, graph_id], dtype=torch.int64)


def decode_message(
    message: torch.Tensor, device: torch.device, kinds: SignatureKinds = TARGET_KINDS
) -> ForwardStep | KvMove | GraphDefine | GraphRun | None:
    """What a message asks a rank to run (a define of one of ``kinds``); None: stop."""
    op = message_op(message)
    if op == OP_GRAPH_RUN:
        return GraphRun(int(message[2]))
    if op != OP_GRAPH_DEFINE:
        return decode(message, device)
    it = iter(message[2:].tolist())
    graph_id, capture, kind = take(it, 3)
    if kind not in kinds:
        raise ValueError(f"step message: unknown forward kind {kind}")
    return GraphDefine(graph_id, kinds[kind](it), bool(capture))

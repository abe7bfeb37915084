"""A draft split over its target's ranks, as vLLM and SGLang split theirs: each rank holds
its share of the draft layers' heads and channels and of the LM head's vocabulary, and
its share of the draft KV heads (``engine.spec.drafters``, built over a split target).

Rank 0 runs the drafter as on one device, through ``SplitDrafter``: before each ``extend``
and ``propose`` it sends the other ranks the forward's shape (``ExtendSignature``,
``ProposeSignature``) and broadcasts its tensors (tokens and layout, target features;
where each row's drafts start), then each draft token it chooses, so that every rank's
chain goes on from the same token. The other ranks run the same drafter over their
shards (``DraftMirror``), meeting rank 0 in the layers' all-reduces and the logits'
all-gather; they choose nothing. Inside the graph runner's steps these forwards are
graphs of their own, named before each replay (``engine.executor.graph_steps``).

Rank 0 still samples, accepts, and masks drafts with grammars, over the whole logits.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from engine.attention.base import AttentionBackend, BatchLayout
from engine.executor.graph_steps import OpRunner
from engine.executor.graph_wire import (
    DTYPES,
    TARGET_KINDS,
    GraphSignature,
    SignatureKinds,
    pack,
    take,
    views,
)
from engine.executor.inputs import ForwardInputs, forward_tensors
from engine.executor.multiproc import MultiprocExecutor
from engine.kv_cache import PagedKVCache
from engine.models.llama3 import ModelOutputs
from engine.parallel.group import TensorParallelGroup
from engine.spec.drafters.base import (
    Drafter,
    DraftLogits,
    DraftSignature,
    KVLayers,
    ProposeArgs,
    SelectFn,
)


@dataclass(frozen=True)
class ExtendSignature:
    """A split draft's ``extend``: its tokens and layout (as a forward's, without logits),
    then its target features ``[T, F]`` of ``DTYPES[dtype]``."""

    kind: ClassVar[int] = 1
    layout: GraphSignature
    features: tuple[int, int]
    dtype: int

    @classmethod
    def of(cls, inputs: ForwardInputs, features: torch.Tensor) -> ExtendSignature:
        t, f = features.shape
        return cls(GraphSignature.of(inputs, compiled=False), (t, f), DTYPES.index(features.dtype))

    def buffers(self, device: torch.device) -> list[torch.Tensor]:
        features = torch.zeros(self.features, dtype=DTYPES[self.dtype], device=device)
        return [*self.layout.buffers(device), features]

    def to_ints(self) -> list[int]:
        return [*self.layout.to_ints(), *self.features, self.dtype]

    @classmethod
    def from_ints(cls, it: Iterator[int]) -> ExtendSignature:
        layout = GraphSignature.from_ints(it)
        t, f, dtype = take(it, 3)
        return cls(layout, (t, f), dtype)


@dataclass(frozen=True)
class ProposeSignature:
    """A split draft's ``propose``: ``k`` drafts for ``batch`` rows whose block tables are
    ``width`` wide; its tensors are ``propose_tensors`` packed."""

    kind: ClassVar[int] = 2
    k: int
    batch: int
    width: int
    block_size: int
    max_context_len: int

    @classmethod
    def of(cls, args: ProposeArgs, k: int) -> ProposeSignature:
        b, width = args.block_tables.shape
        return cls(k, b, width, args.block_size, args.max_context_len)

    def buffers(self, device: torch.device) -> list[torch.Tensor]:
        numel = self.batch * (3 + self.width)
        return [torch.zeros(numel, dtype=torch.int64, device=device)]

    def args(self, packed: torch.Tensor) -> ProposeArgs:
        b = self.batch
        last_index, last_positions, next_tokens, tables = views(
            packed, ((b,), (b,), (b,), (b, self.width))
        )
        return ProposeArgs(
            last_index, last_positions, next_tokens, tables, self.block_size, self.max_context_len
        )

    def to_ints(self) -> list[int]:
        return [self.k, self.batch, self.width, self.block_size, self.max_context_len]

    @classmethod
    def from_ints(cls, it: Iterator[int]) -> ProposeSignature:
        return cls(*take(it, 5))


def propose_tensors(args: ProposeArgs) -> list[torch.Tensor]:
    return [args.last_index, args.last_positions, args.next_tokens, args.block_tables]


# What the other ranks of a split draft read: the target's forwards and the draft's.
SPLIT_DRAFT_KINDS: SignatureKinds = {
    **TARGET_KINDS,
    ExtendSignature.kind: ExtendSignature.from_ints,
    ProposeSignature.kind: ProposeSignature.from_ints,
}


class SplitDrafter:
    """Rank 0's drafter: ``drafter`` (its shard), each forward sent to the other ranks
    first (through ``executor``'s graph peers), and failing as the target's forwards fail
    (``executor.in_step``: the ranks out of step, the engine stopped). Everything else is
    the drafter's own."""

    max_num_layers: ClassVar[int | None] = None  # the drafter's kind checked it at load

    def __init__(self, drafter: Drafter, executor: MultiprocExecutor) -> None:
        self.drafter, self.executor = drafter, executor
        self.peers, self.tp = executor.graph_peers, executor.ranks.tp
        self.kind = drafter.kind
        self.target_hidden = drafter.target_hidden
        self.fixed_num_draft_tokens = drafter.fixed_num_draft_tokens

    @property
    def config(self) -> Any:
        return self.drafter.config

    def signature(self) -> DraftSignature:
        return self.drafter.signature()

    def features(self, out: ModelOutputs) -> torch.Tensor:
        return self.drafter.features(out)

    def __getattr__(self, name: str) -> Any:  # the rest (layer ids, block size): the drafter's
        return getattr(self.drafter, name)

    def extend(
        self,
        tokens: torch.Tensor,
        features: torch.Tensor,
        layout: BatchLayout,
        metadata: Any,
        kv: KVLayers,
        backend: AttentionBackend,
    ) -> torch.Tensor | None:
        inputs = ForwardInputs(tokens, layout, tokens.new_zeros(0))  # no logits
        features = features.contiguous()
        with self.executor.in_step():
            self.peers.send_op(
                ExtendSignature.of(inputs, features), [pack(forward_tensors(inputs)), features]
            )
            return self.drafter.extend(tokens, features, layout, metadata, kv, backend)

    def propose(
        self,
        state: torch.Tensor | None,
        args: ProposeArgs,
        k: int,
        select: SelectFn,
        kv: KVLayers,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        def chosen_for_all(scores: DraftLogits, j: int) -> torch.Tensor:
            return self.tp.broadcast(select(scores, j).contiguous())

        with self.executor.in_step():
            self.peers.send_op(ProposeSignature.of(args, k), [pack(propose_tensors(args))])
            return self.drafter.propose(state, args, k, chosen_for_all, kv, backend)


class DraftMirror:
    """A rank other than 0: its shard of the draft and of the draft KV, run as rank 0's
    ``SplitDrafter`` says (``runners``, for ``engine.executor.graph_steps``)."""

    def __init__(
        self,
        drafter: Drafter,
        kv: PagedKVCache,
        backend: AttentionBackend,
        tp: TensorParallelGroup,
    ) -> None:
        self.drafter, self.kv, self.backend, self.tp = drafter, kv, backend, tp
        self.state: torch.Tensor | None = None  # the last extend's, which propose reads

    def runners(self) -> dict[type, OpRunner]:
        return {ExtendSignature: self._extend, ProposeSignature: self._propose}

    def _extend(
        self, signature: ExtendSignature, buffers: list[torch.Tensor]
    ) -> Callable[[], None]:
        packed, features = buffers
        inputs = signature.layout.inputs(packed)

        def run() -> None:
            metadata = self.backend.build_metadata(inputs.layout)
            self.state = self.drafter.extend(
                inputs.tokens, features, inputs.layout, metadata, self.kv.layers, self.backend
            )

        return run

    def _propose(
        self, signature: ProposeSignature, buffers: list[torch.Tensor]
    ) -> Callable[[], None]:
        args = signature.args(buffers[0])

        def rank_0s(scores: DraftLogits, j: int) -> torch.Tensor:
            token = torch.empty(signature.batch, dtype=torch.int64, device=args.next_tokens.device)
            return self.tp.broadcast(token)

        def run() -> None:
            self.drafter.propose(
                self.state, args, signature.k, rank_0s, self.kv.layers, self.backend
            )

        return run

"""A draft under data-parallel attention (issue 39): each rank holds the whole draft and
its own draft KV pool, beside its target rows' pool, and runs the draft for its own rows,
as it runs the target's. Block ids are that rank's (``engine.dp_blocks``).

Rank 0 drives it through ``DataParallelDrafter``: before each ``extend`` and ``propose`` it
sends the other ranks the forward (``RowsExtendSignature``, ``RowsProposeSignature``: the
whole batch, each row's rank, and for a proposal where each row's state sits in its
rank's extend) and broadcasts its tensors. Each rank then runs its rows (``DraftRows``).

- **Greedy drafts** (argmax, no grammar: ``argmax_drafts``, most steps): each rank
  chooses its own rows' drafts, and the drafts are gathered once, at the end.
- **Sampled or grammar-masked drafts:** at each draft position every rank's scores are
  gathered in the batch's order, rank 0 chooses the drafts of every row as on one
  device and broadcasts them, and each rank's chain goes on from its rows' tokens. That
  moves every row's scores over the draft vocabulary at each position.

A rank with no rows joins the gathers and broadcasts alone. The draft's forwards have no
collectives of their own: an MTP layer's experts are whole on every rank (one MoE layer
on each, in the model's dtype), and where a data-parallel rank's attention splits over
several ranks (tensor parallelism inside it), each borrows a whole copy of the target's
embedding and LM head (``engine.components``), not the split ones. The target's
features reach rank 0 for every row (``engine.executor.data_parallel`` gathers the
hidden states the drafts read, which rank 0 also keeps for deferred drafting), and
travel to the ranks with each extend: one more pass over the group a step.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from engine.attention.base import AttentionBackend, BatchLayout
from engine.executor.data_parallel import batch_order, cut_rows, host_lens
from engine.executor.graph_steps import OpRunner
from engine.executor.graph_wire import SignatureKinds, optional_ints, pack, take_optional
from engine.executor.inputs import ForwardInputs, forward_tensors
from engine.executor.multiproc import MultiprocExecutor
from engine.kv_cache import PagedKVCache
from engine.models.moe import DataParallelStep
from engine.parallel.group import TensorParallelGroup
from engine.spec.drafters.base import (
    Drafter,
    DraftLogits,
    KVLayers,
    ProposeArgs,
    SelectFn,
    argmax_drafts,
)
from engine.spec.split_draft import (
    ExtendSignature,
    ProposeSignature,
    SplitDrafter,
    propose_tensors,
)


@dataclass(frozen=True)
class RowsExtendSignature:
    """An ``extend`` over the whole batch (``extend``: its layout with host lengths, and
    its features), each row run by rank ``row_ranks[row]``."""

    kind: ClassVar[int] = 3
    extend: ExtendSignature
    row_ranks: tuple[int, ...]

    def buffers(self, device: torch.device) -> list[torch.Tensor]:
        return self.extend.buffers(device)

    def to_ints(self) -> list[int]:
        return [*self.extend.to_ints(), *optional_ints(self.row_ranks)]

    @classmethod
    def from_ints(cls, it: Iterator[int]) -> RowsExtendSignature:
        extend = ExtendSignature.from_ints(it)
        return cls(extend, take_optional(it) or ())


@dataclass(frozen=True)
class RowsProposeSignature:
    """A ``propose`` over the whole batch: row b by rank ``row_ranks[b]``, from entry
    ``local_index[b]`` of that rank's last extend; ``greedy``: argmax drafts, which each
    rank chooses for its own rows (else rank 0 chooses every row's)."""

    kind: ClassVar[int] = 4
    propose: ProposeSignature
    row_ranks: tuple[int, ...]
    local_index: tuple[int, ...]
    greedy: bool

    def buffers(self, device: torch.device) -> list[torch.Tensor]:
        return self.propose.buffers(device)

    def to_ints(self) -> list[int]:
        ints = [*self.propose.to_ints(), *optional_ints(self.row_ranks)]
        return [*ints, *optional_ints(self.local_index), self.greedy]

    @classmethod
    def from_ints(cls, it: Iterator[int]) -> RowsProposeSignature:
        propose = ProposeSignature.from_ints(it)
        ranks, local = take_optional(it) or (), take_optional(it) or ()
        return cls(propose, ranks, local, bool(next(it)))


# What data-parallel ranks read besides the target's forwards.
DATA_PARALLEL_DRAFT_KINDS: SignatureKinds = {
    RowsExtendSignature.kind: RowsExtendSignature.from_ints,
    RowsProposeSignature.kind: RowsProposeSignature.from_ints,
}


class DraftRows:
    """One rank's part of a data-parallel draft: the whole drafter over its own rows and
    its own draft KV pool."""

    def __init__(
        self,
        drafter: Drafter,
        kv: PagedKVCache,
        backend: AttentionBackend,
        group: TensorParallelGroup,
    ) -> None:
        # ``group``: every rank of the worker (the sync, rank 0's broadcasts); rows are
        # gathered over the ranks of this one's tensor-parallel rank, one per data-parallel
        # rank (``DataParallelLayout.rows``). Each data-parallel rank's ranks run its rows.
        self.drafter, self.kv, self.backend, self.group = drafter, kv, backend, group
        rows = group.data_parallel.rows if group.data_parallel is not None else group
        self.me, self.num_ranks = rows.shard.rank, rows.size  # data-parallel
        self.rows = DataParallelStep(rows)  # gathers of rows, in data-parallel rank order
        self.state: torch.Tensor | None = None  # its rows' last extend's, propose reads it
        # A zero-row score of the drafter's: the width, dtype and ids of what a rank
        # with no rows brings to each position's gather.
        weight = next(iter(drafter.parameters()))  # type: ignore[attr-defined]
        probe = torch.zeros(1, drafter.config.hidden_size, dtype=weight.dtype, device=weight.device)
        with torch.inference_mode():
            scores = drafter.logits(probe)  # type: ignore[attr-defined]
        self.no_scores = dataclasses.replace(scores, values=scores.values[:0])

    def extend(
        self,
        inputs: ForwardInputs,  # the whole batch's tokens and layout
        features: torch.Tensor,  # [T, F]: every token's
        row_ranks: tuple[int, ...],
    ) -> None:
        mine = [row for row, r in enumerate(row_ranks) if r == self.me]
        self.state = None
        if mine:
            cut, index = cut_rows(inputs, mine, [])
            layout = cut.layout
            self.state = self.drafter.extend(
                cut.tokens,
                features[index],
                layout,
                self.backend.build_metadata(layout),
                self.kv.layers,
                self.backend,
            )
        # Every rank's draft KV of it written once rank 0 returns: a prefill worker's
        # listener may read the pools (engine.executor.shared_kv) right after.
        self.group.all_reduce(features.new_zeros(1))

    def propose(
        self,
        args: ProposeArgs,  # the whole batch's (``last_index`` unread)
        k: int,
        row_ranks: tuple[int, ...],
        local_index: tuple[int, ...],
        choose: Callable[[DraftLogits, int], torch.Tensor] | None,  # every row's scores ->
    ) -> torch.Tensor:  # drafts: rank 0's choice (elsewhere its broadcast); None: argmax
        """Every row's ``k`` drafts, [B, k] in the batch's order, its own rows' drafted
        here. Argmax drafts cost one gather of the drafts at the end; others, a gather of
        every row's scores and a broadcast of rank 0's choice at each position."""
        mine = [b for b, r in enumerate(row_ranks) if r == self.me]
        counts = [row_ranks.count(r) for r in range(self.num_ranks)]
        order = torch.tensor(batch_order(list(row_ranks), self.num_ranks),
                             dtype=torch.int64, device=args.next_tokens.device)  # fmt: skip
        picked = torch.tensor(mine, dtype=torch.int64, device=order.device)
        chosen: list[torch.Tensor] = []  # each position's, every row's

        def select(scores: DraftLogits, j: int) -> torch.Tensor:
            assert choose is not None
            values = self.rows.gather_rows(scores.values.contiguous(), counts)[order]
            chosen.append(choose(dataclasses.replace(scores, values=values), j))
            return chosen[-1][picked]

        drafts = args.next_tokens.new_zeros((0, k))  # its rows'
        if mine:
            last = torch.tensor([local_index[b] for b in mine], dtype=torch.int64,
                                device=order.device)  # fmt: skip
            own = ProposeArgs(
                last_index=last,
                last_positions=args.last_positions[picked],
                next_tokens=args.next_tokens[picked],
                block_tables=args.block_tables[picked],
                block_size=args.block_size,
                max_context_len=args.max_context_len,
            )
            by = argmax_drafts if choose is None else select
            drafts = self.drafter.propose(self.state, own, k, by, self.kv.layers, self.backend)
        elif choose is not None:  # no chain: every position's gather and choice all the same
            for j in range(k):
                select(self.no_scores, j)
        if choose is not None:
            return torch.stack(chosen, dim=1)
        return self.rows.gather_rows(drafts.contiguous(), counts)[order]


class DataParallelDrafter(SplitDrafter):
    """Rank 0's drafter under data-parallel attention. The engine names each row's rank
    (``row_ranks``) before an extend; a proposal's rows are some of its last extend's."""

    def __init__(self, drafter: Drafter, executor: MultiprocExecutor, kv: PagedKVCache) -> None:
        super().__init__(drafter, executor)
        self.own = DraftRows(drafter, kv, executor.backend, executor.ranks.tp)
        self.row_ranks: list[int] = []  # the next extend's rows' ranks
        # The last extend's: each row's rank, first entry, and first entry on its rank.
        self._extended: tuple[tuple[int, ...], list[int], list[int]] = ((), [], [])

    def extend(
        self,
        tokens: torch.Tensor,
        features: torch.Tensor,
        layout: BatchLayout,
        metadata: Any,
        kv: KVLayers,
        backend: AttentionBackend,
    ) -> torch.Tensor | None:
        query_lens, context_lens = host_lens(layout)
        if len(self.row_ranks) != len(query_lens):
            raise RuntimeError(
                f"data-parallel draft: {len(query_lens)} rows to extend, "
                f"{len(self.row_ranks)} ranks named"
            )
        layout = dataclasses.replace(layout, query_lens=query_lens, context_lens_host=context_lens)
        inputs = ForwardInputs(tokens, layout, tokens.new_zeros(0))  # no logits
        features = features.contiguous()
        ranks = tuple(self.row_ranks)
        done = [0] * self.own.num_ranks  # each data-parallel rank's entries before each row
        starts = []
        for rank, n in zip(ranks, query_lens, strict=True):
            starts.append(done[rank])
            done[rank] += n
        self._extended = (ranks, [0, *itertools.accumulate(query_lens)], starts)
        signature = RowsExtendSignature(ExtendSignature.of(inputs, features), ranks)
        with self.executor.in_step():
            self.peers.send_op(signature, [pack(forward_tensors(inputs)), features])
            self.own.extend(inputs, features, ranks)
        return None  # each rank keeps its rows' state

    def propose(
        self,
        state: torch.Tensor | None,
        args: ProposeArgs,
        k: int,
        select: SelectFn,
        kv: KVLayers,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        row_ranks, offsets, starts = self._extended
        last = args.last_index.tolist()
        rows = [bisect.bisect_right(offsets, i) - 1 for i in last]  # the extend's rows
        local = tuple(starts[r] + i - offsets[r] for r, i in zip(rows, last, strict=True))
        ranks = tuple(row_ranks[r] for r in rows)
        greedy = select is argmax_drafts

        def choose(scores: DraftLogits, j: int) -> torch.Tensor:
            return self.tp.broadcast(select(scores, j).contiguous())

        signature = RowsProposeSignature(ProposeSignature.of(args, k), ranks, local, greedy)
        with self.executor.in_step():
            self.peers.send_op(signature, [pack(propose_tensors(args))])
            return self.own.propose(args, k, ranks, local, None if greedy else choose)


def name_ranks(drafter: object, ranks: Iterable[int]) -> None:
    """Under data-parallel attention (``drafter`` a ``DataParallelDrafter``), each row's
    rank, in the rows' order, for the draft's next extend; read only then (a decode
    step passes a generator, which costs nothing elsewhere)."""
    if isinstance(drafter, DataParallelDrafter):
        drafter.row_ranks = list(ranks)


class DataParallelDraftMirror:
    """A rank other than 0: its rows of each draft forward rank 0 sends (``runners``)."""

    def __init__(self, rows: DraftRows) -> None:
        self.rows = rows

    def runners(self) -> dict[type, OpRunner]:
        return {RowsExtendSignature: self._extend, RowsProposeSignature: self._propose}

    def _extend(
        self, signature: RowsExtendSignature, buffers: list[torch.Tensor]
    ) -> Callable[[], None]:
        packed, features = buffers
        inputs = signature.extend.layout.inputs(packed)
        return lambda: self.rows.extend(inputs, features, signature.row_ranks)

    def _propose(
        self, signature: RowsProposeSignature, buffers: list[torch.Tensor]
    ) -> Callable[[], None]:
        args = signature.propose.args(buffers[0])
        batch = signature.propose.batch

        def rank_0s(scores: DraftLogits, j: int) -> torch.Tensor:
            token = torch.empty(batch, dtype=torch.int64, device=args.next_tokens.device)
            return self.rows.group.broadcast(token)  # the worker's: from rank 0

        def run() -> None:
            self.rows.propose(
                args,
                signature.propose.k,
                signature.row_ranks,
                signature.local_index,
                None if signature.greedy else rank_0s,
            )

        return run

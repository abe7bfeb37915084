"""What the services read of an engine besides its outputs: its figures (for Stats and
heartbeats), which blocks requests own (for audits), and their block tables (for the
ledger's holdings). The engine package is the one place that reads its scheduler's and
block manager's state for them; each runs on the engine thread."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from engine.dp_blocks import DataParallelBlocks, whole_table
from engine.llm_engine import LLMEngine


@dataclass(frozen=True)
class EngineStats:
    """Figures for Stats and heartbeats, taken by the engine thread after every iteration."""

    num_blocks: int = 0
    num_free_blocks: int = 0
    num_running: int = 0
    num_waiting: int = 0
    max_num_seqs: int = 1
    # Speculative decoding counters since start (engine.spec.stats); None without a draft.
    num_drafts: int | None = None
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_steps_without_drafts: int = 0  # row-steps that verified none
    steps_per_k: tuple[int, ...] = ()  # [k]: decode steps that verified k drafts
    max_k: int = 0  # the most drafts a step verifies (--num-draft-tokens); 0 without drafts
    # Data-parallel attention: each rank's free blocks, of ``num_blocks / len`` each.
    num_free_blocks_per_rank: tuple[int, ...] = ()

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def load(self) -> float:
        """The larger of block usage and batch-slot usage, in [0, 1]. Under data-parallel
        attention, the block usage of the rank with most blocks free: one rank holds a
        request, so routing balances by each rank's room, not the worker's sum."""
        blocks = self.num_used_blocks / self.num_blocks if self.num_blocks else 0.0
        if self.num_free_blocks_per_rank and self.num_blocks:
            per_rank = self.num_blocks // len(self.num_free_blocks_per_rank)
            blocks = 1.0 - max(self.num_free_blocks_per_rank) / per_rank
        return min(1.0, max(blocks, (self.num_running + self.num_waiting) / self.max_num_seqs))


def engine_stats(engine: LLMEngine) -> EngineStats:
    bm = engine.block_manager
    spec = engine.spec.stats if engine.spec is not None else None
    return EngineStats(
        num_blocks=bm.total_blocks,
        num_free_blocks=bm.num_free_blocks,
        num_free_blocks_per_rank=(
            tuple(bm.free_blocks_per_rank) if isinstance(bm, DataParallelBlocks) else ()
        ),
        num_running=len(engine.scheduler.running),
        num_waiting=len(engine.scheduler.waiting),
        max_num_seqs=engine.scheduler.config.max_num_seqs,
        num_drafts=spec.num_drafts if spec is not None else None,
        num_draft_tokens=spec.num_draft_tokens if spec is not None else 0,
        num_accepted_tokens=spec.num_accepted_tokens if spec is not None else 0,
        num_steps_without_drafts=spec.num_steps_without_drafts if spec is not None else 0,
        steps_per_k=tuple(spec.steps_per_k) if spec is not None else (),
        max_k=engine.spec.k if engine.spec is not None else 0,
    )


@dataclass(frozen=True)
class OwnedBlocks:
    """The allocator as an audit compares it with the ledger: block ids held by requests,
    how many requests hold each (more than one where they share a cached prefix), and the
    free ones holding a cached prefix."""

    owned: list[int]
    ref_counts: list[int]  # of owned, in its order
    cached: list[int]


def owned_block_ids(engine: LLMEngine) -> OwnedBlocks:
    """The engine's ``OwnedBlocks``. Data-parallel ranks' ids are numbered on: rank r's
    block b is ``r * num_blocks + b``."""
    manager = engine.block_manager
    ranks = manager.ranks if isinstance(manager, DataParallelBlocks) else [manager]
    owned: list[int] = []
    ref_counts: list[int] = []
    cached: list[int] = []
    for r, rank in enumerate(ranks):
        first = r * rank.num_blocks
        for b in rank.blocks:
            if b.ref_count > 0:
                owned.append(first + b.block_id)
                ref_counts.append(b.ref_count)
            elif b.hash is not None:
                cached.append(first + b.block_id)
    return OwnedBlocks(owned, ref_counts, cached)


def block_tables(engine: LLMEngine, request_ids: Collection[str]) -> dict[str, list[int]]:
    """The block tables of those of ``request_ids`` in the engine's batch (running or
    waiting), as the transfers' pools number them; a request reserved but not started, or
    already ended, is not there."""
    wanted = set(request_ids)
    scheduler = engine.scheduler
    return {
        seq.request_id: whole_table(engine.block_manager, seq)
        for seq in (*scheduler.running, *scheduler.waiting)
        if seq.request_id in wanted
    }


class BlockTableWatch:
    """The block tables of running requests that changed since the last look: how a decode
    worker learns, once per step, which of its requests grew (engine thread only). Ids as
    the transfers' pools number them (``whole_table``)."""

    def __init__(self) -> None:
        self._tables: dict[str, list[int]] = {}

    def changed(self, engine: LLMEngine) -> dict[str, list[int]]:
        """Request id -> a copy of its table, for those that differ from the last look
        (a request seen for the first time included)."""
        changed: dict[str, list[int]] = {}
        tables: dict[str, list[int]] = {}
        for seq in engine.scheduler.running:
            table = self._tables.get(seq.request_id)
            if table != seq.block_table:  # this rank's ids, compared without a copy a step
                table = list(seq.block_table)
                changed[seq.request_id] = whole_table(engine.block_manager, seq)
            tables[seq.request_id] = table
        self._tables = tables  # ended requests drop out
        return changed

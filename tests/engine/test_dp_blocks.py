"""DataParallelBlocks: each data-parallel rank's blocks in its own manager, ids local to
its pool; a request placed where its cached prefix is, else where most blocks are free,
and admitted only where one rank can hold it; numbered as one pool for transfers."""

from __future__ import annotations

import pytest

from engine.block_manager import BlockManager
from engine.dp_blocks import DataParallelBlocks, rank_of, whole_table
from engine.engine_figures import EngineStats
from tests.engine.test_block_manager import compute, make_seq


def test_requests_spread_over_ranks_with_ids_of_their_own_pool() -> None:
    blocks = DataParallelBlocks(2, num_blocks=6, block_size=4)
    first, second, third = make_seq([1] * 8), make_seq([2] * 8), make_seq([3] * 4)
    for seq in (first, second, third):
        blocks.allocate(seq)
    assert (first.dp_rank, second.dp_rank, third.dp_rank) == (0, 1, 0)  # most free, lowest
    assert first.block_table == [0, 1] and second.block_table == [0, 1]  # each rank's ids
    assert third.block_table == [2]
    assert blocks.free_blocks_per_rank == [3, 4] and blocks.num_free_blocks == 7
    second.num_computed_tokens = 8
    blocks.append(second, 1)  # its ninth token: a third block, on rank 1
    assert second.block_table == [0, 1, 2] and blocks.free_blocks_per_rank == [3, 3]
    blocks.free(first)
    assert blocks.free_blocks_per_rank == [5, 3]


def test_a_cached_prefix_draws_its_request_to_the_rank_holding_it() -> None:
    blocks = DataParallelBlocks(2, num_blocks=8, block_size=4)
    prompt = list(range(10, 22))  # three blocks
    first = make_seq(prompt)
    blocks.allocate(first)
    compute(blocks.ranks[first.dp_rank], first)
    blocks.free(first)  # its blocks stay cached on rank 0, free but evictable
    hog = make_seq([5] * 8)
    blocks.allocate(hog)  # a tie in free blocks: rank 0, which now has fewer
    assert hog.dp_rank == 0 and blocks.free_blocks_per_rank == [6, 8]
    again = make_seq([*prompt, 99])
    blocks.allocate(again)
    assert again.dp_rank == 0 and again.num_cached_tokens == 12
    assert blocks.num_prefix_hit_blocks == 3


def test_capacity_is_per_rank() -> None:
    blocks = DataParallelBlocks(2, num_blocks=4, block_size=4)
    blocks.allocate(make_seq([1] * 4))
    blocks.allocate(make_seq([2] * 4))
    assert blocks.free_blocks_per_rank == [3, 3]
    big = make_seq([3] * 16)  # four blocks: six free in all, three on each rank
    assert not blocks.can_allocate(big)
    with pytest.raises(MemoryError, match=r"no data-parallel rank has room .* \[3, 3\]"):
        blocks.allocate(big)
    fits = make_seq([4] * 12)
    assert blocks.can_allocate(fits)
    blocks.allocate(fits)
    assert blocks.free_blocks_per_rank == [0, 3]


def test_a_row_that_cannot_grow_preempts_only_on_its_own_rank() -> None:
    """Rank 0's request needs a block and its rank has none: freeing rank 1's requests
    would not help it, so it is the one preempted, and they keep running."""
    from engine.scheduler import Scheduler, SchedulerConfig

    blocks = DataParallelBlocks(2, num_blocks=3, block_size=4)
    scheduler = Scheduler(SchedulerConfig(8, 64), blocks)
    # Rank 0 full with the first; the others fit in a block each on rank 1, growing or not.
    first, second, third = make_seq([1] * 12), make_seq([2] * 2), make_seq([3] * 2)
    for seq in (first, second, third):
        scheduler.add(seq)
    batch = scheduler.schedule()
    assert [s.dp_rank for s in batch.seqs] == [0, 1, 1]
    for seq in batch.seqs:  # their prompts computed, each a token longer
        seq.num_computed_tokens = seq.num_tokens
        seq.token_ids.append(9)
    batch = scheduler.schedule()
    assert batch.preempted == [first]
    assert batch.seqs == [second, third]


def test_transfers_and_load_see_every_ranks_blocks_in_one_numbering() -> None:
    """``whole_table``: rank r's block b is ``r * num_blocks + b`` of a pool of every
    rank's (a shared segment); one rank's blocks as they are. The engine's load counts the
    rank with most room: one full rank beside an empty one leaves the engine unloaded."""
    blocks = DataParallelBlocks(2, num_blocks=6, block_size=4)
    first, second = make_seq([1] * 8), make_seq([2] * 4)
    blocks.allocate(first)
    blocks.allocate(second)
    assert (first.dp_rank, second.dp_rank) == (0, 1)
    assert whole_table(blocks, first) == [0, 1] and whole_table(blocks, second) == [6]
    assert (rank_of(blocks, 1), rank_of(blocks, 6)) == (0, 1)  # what a reservation names
    alone = BlockManager(6, 4)
    third = make_seq([3] * 8)
    alone.allocate(third)
    assert whole_table(alone, third) == [0, 1] and alone.total_blocks == 6
    assert rank_of(alone, 5) == 0
    assert blocks.total_blocks == 12
    full_and_empty = EngineStats(num_blocks=12, num_free_blocks=6, num_free_blocks_per_rank=(0, 6))
    assert full_and_empty.load == 0.0
    half_each = EngineStats(num_blocks=12, num_free_blocks=6, num_free_blocks_per_rank=(3, 3))
    assert half_each.load == 0.5
    assert EngineStats(num_blocks=12, num_free_blocks=6).load == 0.5  # one pool: its usage
    # Scratch steps (warm-up, adaptive K's costs) put rows on any rank: ids clean on all.
    assert blocks.clean_block_ids == [2, 3, 4, 5]  # rank 0 holds 0 and 1, rank 1 holds 0

"""BlockManager: rule-based property tests over allocate / grow / compute / free, with a
shadow of what each block's KV holds, plus unit tests for prefix hits and id order."""

from __future__ import annotations

import copy
import itertools

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from engine.block_manager import BlockManager
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence

_ids = itertools.count()


def make_seq(tokens: list[int]) -> Sequence:
    n = next(_ids)
    return Sequence(f"r{n}", list(tokens), len(tokens), SamplingParams(), seed=0)


def compute(bm: BlockManager, seq: Sequence, upto: int | None = None) -> None:
    """What the engine does after a step: the KV of tokens up to ``upto`` is now written."""
    seq.num_computed_tokens = seq.num_tokens if upto is None else upto
    bm.cache_computed_blocks(seq)


def owned(bm: BlockManager) -> set[int]:
    return {b.block_id for b in bm.blocks if b.ref_count > 0}


# -- rule-based machine -------------------------------------------------------------------

TOKENS = st.lists(st.integers(0, 2), min_size=1, max_size=30)  # tiny alphabet: prefixes repeat


class BlockManagerMachine(RuleBasedStateMachine):
    """Sequences come and go; a shadow records, per block slot, the token prefix whose KV
    that slot holds, so every prefix hit can be checked against what was really computed."""

    @initialize(num_blocks=st.integers(8, 40), block_size=st.integers(1, 8))
    def setup(self, num_blocks: int, block_size: int) -> None:
        self.bm = BlockManager(num_blocks, block_size)
        self.bs = block_size
        self.live: list[Sequence] = []
        self.kv: dict[int, dict[int, tuple[int, ...]]] = {}  # block -> slot -> token prefix
        self.num_allocs = 0

    # helpers ----------------------------------------------------------------------------

    def _write_kv(self, seq: Sequence, start: int, stop: int) -> None:
        for pos in range(start, stop):
            block_id = seq.block_table[pos // self.bs]
            assert self.bm.blocks[block_id].ref_count == 1, (
                f"writing KV of position {pos} into block {block_id} shared by "
                f"{self.bm.blocks[block_id].ref_count} sequences"
            )
            self.kv.setdefault(block_id, {})[pos % self.bs] = tuple(seq.token_ids[: pos + 1])

    def _advance(self, seq: Sequence, upto: int) -> None:
        self._write_kv(seq, seq.num_computed_tokens, upto)
        compute(self.bm, seq, upto)

    # rules -------------------------------------------------------------------------------

    @rule(tokens=TOKENS, data=st.data())
    def allocate(self, tokens: list[int], data: st.DataObject) -> None:
        if self.live and data.draw(st.booleans(), label="share_prefix"):
            other = data.draw(st.sampled_from(self.live), label="prefix_of")
            cut = data.draw(st.integers(1, other.num_tokens), label="cut")
            tokens = other.token_ids[:cut] + tokens[: data.draw(st.integers(0, 8))]
        seq = make_seq(tokens)
        bm = self.bm
        needed = bm.num_blocks_for(len(tokens))
        free_before = bm.num_free_blocks
        clean_before = list(bm._clean)
        if not bm.can_allocate(seq):
            assert needed > free_before, "can_allocate is false although every block fits"
            bm2, seq2 = copy.deepcopy(bm), copy.deepcopy(seq)
            with pytest.raises(MemoryError):
                bm2.allocate(seq2)
            return
        bm.allocate(seq)
        self.num_allocs += 1
        self.live.append(seq)
        table = seq.block_table
        assert len(table) == needed
        hits = seq.num_cached_tokens // self.bs
        assert seq.num_cached_tokens == hits * self.bs
        assert seq.num_computed_tokens == seq.num_cached_tokens
        assert seq.num_cached_tokens <= len(tokens) - 1, "a hit must leave a token to compute"
        assert len(seq.block_hashes) == hits
        for i in range(hits):  # every reused slot holds the KV of exactly this prefix
            for slot in range(self.bs):
                pos = i * self.bs + slot
                assert self.kv[table[i]][slot] == tuple(tokens[: pos + 1])
        fresh = table[hits:]
        if hits == 0 and fresh and _has_run(clean_before, len(fresh)):
            assert fresh == list(range(fresh[0], fresh[0] + len(fresh))), fresh

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def compute_some(self, data: st.DataObject) -> None:
        """A prefill chunk: the computed tokens move part of the way to the known tokens."""
        seq = data.draw(st.sampled_from(self.live), label="seq")
        upto = data.draw(st.integers(seq.num_computed_tokens, seq.num_tokens), label="upto")
        self._advance(seq, upto)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), new=st.lists(st.integers(0, 2), min_size=0, max_size=12))
    def grow(self, data: st.DataObject, new: list[int]) -> None:
        """New known tokens (sampled, accepted drafts): make room, then compute them all."""
        seq = data.draw(st.sampled_from(self.live), label="seq")
        bm = self.bm
        seq.token_ids.extend(new)
        num_new = seq.num_tokens - seq.num_computed_tokens
        needed = bm.num_blocks_for(seq.num_tokens) - len(seq.block_table)
        table_before, free_before = list(seq.block_table), bm.num_free_blocks
        clean_before = set(bm._clean)
        if not bm.can_append(seq, num_new):
            assert needed > free_before
            with pytest.raises(MemoryError):
                bm.append(seq, num_new)
            assert seq.block_table == table_before, "a failed append changed the table"
            assert bm.num_free_blocks == free_before
            del seq.token_ids[len(seq.token_ids) - len(new) :]
            return
        bm.append(seq, num_new)
        assert len(seq.block_table) == bm.num_blocks_for(seq.num_tokens)
        added = seq.block_table[len(table_before) :]
        if added and table_before and table_before[-1] + 1 in clean_before:
            assert added[0] == table_before[-1] + 1, "append did not continue the run"
        self._advance(seq, seq.num_tokens)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(self.live), label="seq")
        self.live.remove(seq)
        self.bm.free(seq)
        assert seq.block_table == [] and seq.block_hashes == []

    @rule()
    def reset_prefix_cache(self) -> None:
        self.bm.reset_prefix_cache()
        assert not self.bm._evictable

    # invariants ---------------------------------------------------------------------------

    @invariant()
    def ref_counts_match_tables(self) -> None:
        counts = [0] * self.bm.num_blocks
        for seq in self.live:
            assert len(set(seq.block_table)) == len(seq.block_table), seq.block_table
            assert len(seq.block_table) == self.bm.num_blocks_for(seq.num_tokens)
            for b in seq.block_table:
                counts[b] += 1
        assert [b.ref_count for b in self.bm.blocks] == counts

    @invariant()
    def every_block_in_exactly_one_place(self) -> None:
        bm = self.bm
        clean, evictable, own = set(bm._clean), set(bm._evictable), owned(bm)
        assert len(clean) == len(bm._clean), "a clean id twice"
        assert bm._clean == sorted(bm._clean)
        assert not clean & evictable and not clean & own and not evictable & own
        assert len(clean) + len(evictable) + len(own) == bm.num_blocks
        assert bm.num_free_blocks == len(clean) + len(evictable)
        assert all(bm.blocks[b].hash is None for b in clean)
        assert all(bm.blocks[b].hash is not None for b in evictable)

    @invariant()
    def hash_index_is_consistent(self) -> None:
        bm = self.bm
        registered = {b.hash: b.block_id for b in bm.blocks if b.hash is not None}
        assert registered == bm._by_hash
        for b in bm.blocks:
            if b.hash is not None:
                assert len(b.token_ids) == self.bs

    def teardown(self) -> None:
        if not hasattr(self, "bm"):
            return
        for seq in self.live:
            self.bm.free(seq)
        assert all(b.ref_count == 0 for b in self.bm.blocks)
        assert self.bm.num_free_blocks == self.bm.num_blocks


def _has_run(sorted_ids: list[int], n: int) -> bool:
    run = 0
    for i, b in enumerate(sorted_ids):
        run = run + 1 if i and b == sorted_ids[i - 1] + 1 else 1
        if run >= n:
            return True
    return False


BlockManagerMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestBlockManagerMachine = BlockManagerMachine.TestCase


# -- prefix hits ----------------------------------------------------------------------------


def test_prefix_hit_reuses_the_same_block_ids() -> None:
    bm = BlockManager(16, 4)
    a = make_seq(list(range(10)))  # blocks [0..3] [4..7] [8, 9]
    bm.allocate(a)
    assert a.block_table == [0, 1, 2]
    compute(bm, a)
    b = make_seq([*range(8), 50, 51, 52])
    assert bm.can_allocate(b)
    bm.allocate(b)
    assert b.block_table == [0, 1, 3]
    assert b.num_cached_tokens == 8 and b.num_computed_tokens == 8
    assert [bm.blocks[i].ref_count for i in range(4)] == [2, 2, 1, 1]
    assert bm.num_prefix_hit_blocks == 2


def test_prompt_of_exactly_k_full_blocks_gets_k_minus_1_hits() -> None:
    bm = BlockManager(16, 4)
    a = make_seq(list(range(12)))
    bm.allocate(a)
    compute(bm, a)
    c = make_seq(list(range(12)))
    bm.allocate(c)
    assert c.num_cached_tokens == 8 and c.num_computed_tokens == 8
    assert c.block_table == [0, 1, 3]  # the last token is computed again, in a block of its own
    one = make_seq([0, 1, 2, 3])
    bm.allocate(one)
    assert one.num_cached_tokens == 0 and one.block_table == [4]


def test_hits_only_cover_computed_and_cached_blocks() -> None:
    bm = BlockManager(16, 4)
    a = make_seq(list(range(12)))
    bm.allocate(a)
    a.num_computed_tokens = 12  # computed, but cache_computed_blocks not called yet
    b = make_seq(list(range(13)))
    bm.allocate(b)
    assert b.num_cached_tokens == 0
    bm.free(b)
    compute(bm, a, upto=6)  # only block 0 is full and computed
    c = make_seq(list(range(13)))
    bm.allocate(c)
    assert c.num_cached_tokens == 4 and c.block_table[0] == 0


def test_different_first_block_gets_no_hits() -> None:
    bm = BlockManager(16, 4)
    a = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9])
    bm.allocate(a)
    compute(bm, a)
    b = make_seq([0, 2, 3, 4, 5, 6, 7, 8, 9])  # later blocks equal, first differs
    bm.allocate(b)
    assert b.num_cached_tokens == 0
    assert not set(b.block_table) & set(a.block_table)
    assert bm.num_prefix_hit_blocks == 0


def test_no_hits_with_prefix_caching_disabled() -> None:
    bm = BlockManager(16, 4, enable_prefix_caching=False)
    a = make_seq(list(range(9)))
    bm.allocate(a)
    compute(bm, a)
    bm.free(a)
    assert bm.num_free_blocks == 16 and not bm._evictable
    b = make_seq(list(range(9)))
    bm.allocate(b)
    assert b.num_cached_tokens == 0


def test_hits_survive_free_until_evicted_by_pressure() -> None:
    bm = BlockManager(8, 4)
    a = make_seq(list(range(10)))
    bm.allocate(a)
    compute(bm, a)
    bm.free(a)  # blocks 0, 1 hold cached prefixes; block 2 (partial) is clean again
    assert bm.num_free_blocks == 8
    assert list(bm._evictable) == [1, 0]  # tail first: evicted before the prefix start
    b = make_seq([*range(8), 7])
    assert bm.can_allocate(b)
    bm.allocate(b)
    assert b.block_table == [0, 1, 2] and b.num_cached_tokens == 8
    assert bm.num_free_blocks == 5
    bm.free(b)
    # Pressure: 7 blocks for an unrelated prompt use the 6 clean ones, then evict block 1.
    c = make_seq([100 + i for i in range(28)])
    bm.allocate(c)
    assert sorted(c.block_table) == [1, 2, 3, 4, 5, 6, 7]
    assert list(bm._evictable) == [0]
    bm.free(c)
    d = make_seq(list(range(10)))
    bm.allocate(d)
    assert d.block_table[0] == 0 and d.num_cached_tokens == 4


def test_can_allocate_counts_revived_blocks() -> None:
    bm = BlockManager(4, 2)
    a = make_seq([1, 2, 3, 4, 5])  # 3 blocks
    bm.allocate(a)
    compute(bm, a)
    bm.free(a)
    holder = make_seq([9])
    bm.allocate(holder)  # takes the one clean block
    assert bm.num_free_blocks == 3
    # 4 blocks needed, 2 of them hits on free blocks: 2 more needed, 1 left after reviving.
    b = make_seq([1, 2, 3, 4, 5, 6, 7])
    assert not bm.can_allocate(b)
    c = make_seq([1, 2, 3, 4, 5, 6])  # 3 blocks, 2 hits revived, 1 more: fits exactly
    assert bm.can_allocate(c)
    bm.allocate(c)
    assert c.num_cached_tokens == 4 and bm.num_free_blocks == 0


def test_failed_allocate_leaves_no_trace() -> None:
    """allocate() raising MemoryError must not keep revived prefix blocks."""
    bm = BlockManager(4, 2)
    a = make_seq([1, 2, 3, 4, 5])
    bm.allocate(a)
    compute(bm, a)
    bm.free(a)
    holder = make_seq([9])
    bm.allocate(holder)
    b = make_seq([1, 2, 3, 4, 5, 6, 7])
    assert not bm.can_allocate(b)
    with pytest.raises(MemoryError):
        bm.allocate(b)
    assert b.block_table == []
    assert [blk.ref_count for blk in bm.blocks] == [0, 0, 1, 0]
    assert bm.num_free_blocks == 3
    assert bm.num_prefix_hit_blocks == 0


# -- consecutive ids ------------------------------------------------------------------------


def test_fresh_manager_hands_out_consecutive_runs() -> None:
    bm = BlockManager(20, 4)
    tables = []
    for n in (9, 1, 16, 5):
        seq = make_seq([7] * n if n != 16 else list(range(16)))
        bm.allocate(seq)
        tables.append(seq.block_table)
    assert tables == [[0, 1, 2], [3], [4, 5, 6, 7], [8, 9]]


def test_append_continues_the_run_when_next_id_is_free() -> None:
    bm = BlockManager(10, 2)
    a, b = make_seq([1, 2, 3]), make_seq([4])
    bm.allocate(a)
    bm.allocate(b)
    assert a.block_table == [0, 1] and b.block_table == [2]
    bm.free(b)
    compute(bm, a)
    a.token_ids += [5, 6, 7, 8]  # 7 tokens: two more blocks, 2 (free again) and 3
    bm.append(a, 4)
    assert a.block_table == [0, 1, 2, 3]


def test_append_when_next_id_is_taken_uses_the_first_long_enough_run() -> None:
    bm = BlockManager(12, 1)
    seqs = [make_seq([i] * n) for i, n in enumerate((2, 1, 2, 3, 4))]
    for s in seqs:
        bm.allocate(s)  # [0,1] [2] [3,4] [5,6,7] [8..11]
    bm.free(seqs[1])  # frees 2
    bm.free(seqs[3])  # frees 5, 6, 7
    compute(bm, seqs[2])
    seqs[2].token_ids += [0, 0]  # 2 more blocks: 5 and 6 continue the run after 4
    bm.append(seqs[2], 2)
    assert seqs[2].block_table == [3, 4, 5, 6]
    compute(bm, seqs[0])
    seqs[0].token_ids += [0, 0]  # next id 2 is free: take it, then the next free run
    bm.append(seqs[0], 2)
    assert seqs[0].block_table == [0, 1, 2, 7]


def test_allocate_skips_short_runs_for_a_long_enough_one() -> None:
    bm = BlockManager(10, 1)
    seqs = [make_seq([i] * n) for i, n in enumerate((1, 1, 2, 3, 3))]
    for s in seqs:
        bm.allocate(s)  # [0] [1] [2,3] [4,5,6] [7,8,9]
    bm.free(seqs[1])  # 1
    bm.free(seqs[3])  # 4, 5, 6
    c = make_seq([42, 43, 44])
    bm.allocate(c)
    assert c.block_table == [4, 5, 6]

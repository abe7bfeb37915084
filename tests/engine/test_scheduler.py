"""Scheduler with no model: a simulated engine loop advances computed tokens, caches
full blocks, appends a fake token to rows that sample and finishes requests at max_tokens.
A shadow of each block slot's KV checks that a row samples only over correct KV."""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from engine.block_manager import BlockManager
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from engine.sequence import Sequence, SequenceStatus


def fake_token(seq: Sequence) -> int:
    return (sum(seq.token_ids) + seq.num_tokens) % 3  # tiny alphabet: prefixes repeat


@dataclass
class Sim:
    scheduler: Scheduler
    bm: BlockManager
    seqs: list[Sequence] = field(default_factory=list)
    batches: list[ScheduledBatch] = field(default_factory=list)
    samples: dict[str, int] = field(default_factory=dict)  # request id -> rows that sampled
    preempted: list[str] = field(default_factory=list)
    sampled: list[list[bool]] = field(default_factory=list)  # per step, per row
    kv: dict[int, dict[int, tuple[int, ...]]] = field(default_factory=dict)

    @classmethod
    def new(cls, num_blocks: int, block_size: int, max_num_seqs: int, budget: int) -> Sim:
        bm = BlockManager(num_blocks, block_size)
        return cls(Scheduler(SchedulerConfig(max_num_seqs, budget), bm), bm)

    def add(self, prompt: list[int], max_tokens: int) -> Sequence:
        n = len(self.seqs)
        seq = Sequence(f"r{n}", list(prompt), len(prompt), SamplingParams(max_tokens=max_tokens), 0)
        self.seqs.append(seq)
        self.samples[seq.request_id] = 0
        self.scheduler.add(seq)
        return seq

    def step(self) -> ScheduledBatch:
        sch, bm, cfg = self.scheduler, self.bm, self.scheduler.config
        running_before = list(sch.running)
        waiting_before = list(sch.waiting)
        batch = sch.schedule()
        self.batches.append(batch)
        rows = batch.seqs
        assert len(rows) == len(batch.num_new_tokens)
        assert len(rows) <= cfg.max_num_seqs
        assert batch.num_tokens <= cfg.max_num_batched_tokens
        assert all(n >= 1 for n in batch.num_new_tokens), batch.num_new_tokens
        assert len({id(s) for s in rows}) == len(rows), "a request twice in one batch"

        # Preempted requests wait again, at the front, holding nothing.
        for seq in batch.preempted:
            assert seq in running_before and seq not in rows
            assert seq.status is SequenceStatus.WAITING and seq in sch.waiting
            assert seq.block_table == [] and seq.num_computed_tokens == 0
            self.preempted.append(seq.request_id)
        # ... in their running order, ahead of every request that was already waiting.
        by_age = sorted(batch.preempted, key=running_before.index)
        assert by_age == running_before[len(running_before) - len(by_age) :]
        assert list(sch.waiting)[: len(by_age)] == by_age
        assert batch.preempted == by_age[::-1], "the newest running request goes first"
        # Running requests first; waiting ones are admitted in order, and only when every
        # running request got its tokens.
        num_old = sum(1 for s in rows if s in running_before)
        assert all(s in running_before for s in rows[:num_old])
        admitted = rows[num_old:]
        assert admitted == waiting_before[: len(admitted)], (
            "admission is not first come first served"
        )
        if admitted:
            assert not batch.preempted
            assert set(map(id, rows[:num_old])) == set(map(id, running_before))
        # Each row catches up as far as the budget allows: only the last row may be cut.
        for i, (seq, n) in enumerate(zip(rows, batch.num_new_tokens, strict=True)):
            remaining = seq.num_tokens - seq.num_computed_tokens
            assert n <= remaining
            if n < remaining:
                assert i == len(rows) - 1 and batch.num_tokens == cfg.max_num_batched_tokens
            assert seq.status is SequenceStatus.RUNNING
            assert len(seq.block_table) * bm.block_size >= seq.num_computed_tokens + n
        self._check_blocks()

        # The engine: write KV, advance, cache, sample where a row catches up.
        sampling = [batch.samples(i) for i in range(len(rows))]
        self.sampled.append(sampling)
        for seq, n in zip(rows, batch.num_new_tokens, strict=True):
            self._write_kv(seq, seq.num_computed_tokens, seq.num_computed_tokens + n)
            seq.num_computed_tokens += n
            bm.cache_computed_blocks(seq)
        for seq, samples in zip(rows, sampling, strict=True):
            assert samples == (seq.num_computed_tokens == seq.num_tokens)
            if not samples:
                continue
            self._check_kv(seq)
            self.samples[seq.request_id] += 1
            seq.token_ids.append(fake_token(seq))
            if seq.num_output_tokens >= seq.params.max_tokens:
                sch.finish(seq)
        return batch

    def run(self, arrivals: dict[int, list[tuple[list[int], int]]] | None = None) -> int:
        arrivals = arrivals or {}
        steps = 0
        while self.scheduler.has_unfinished or any(s >= steps for s in arrivals):
            for prompt, max_tokens in arrivals.get(steps, []):
                self.add(prompt, max_tokens)
            if self.scheduler.has_unfinished:
                batch = self.step()
                assert batch.seqs, "no progress although requests are unfinished"
            steps += 1
            assert steps < 10_000
        return steps

    def check_done(self) -> None:
        for seq in self.seqs:
            assert seq.is_finished
            assert seq.num_output_tokens == seq.params.max_tokens
            assert self.samples[seq.request_id] == seq.params.max_tokens
            assert seq.block_table == []
        assert all(b.ref_count == 0 for b in self.bm.blocks)
        assert self.bm.num_free_blocks == self.bm.num_blocks
        assert not self.scheduler.running and not self.scheduler.waiting

    def _check_blocks(self) -> None:
        counts = [0] * self.bm.num_blocks
        for seq in self.scheduler.running:
            assert len(set(seq.block_table)) == len(seq.block_table)
            for b in seq.block_table:
                counts[b] += 1
        for seq in self.scheduler.waiting:
            assert seq.block_table == []
        assert [b.ref_count for b in self.bm.blocks] == counts

    def _write_kv(self, seq: Sequence, start: int, stop: int) -> None:
        bs = self.bm.block_size
        for pos in range(start, stop):
            block_id = seq.block_table[pos // bs]
            assert self.bm.blocks[block_id].ref_count == 1, (
                f"KV written into shared block {block_id}"
            )
            self.kv.setdefault(block_id, {})[pos % bs] = tuple(seq.token_ids[: pos + 1])

    def _check_kv(self, seq: Sequence) -> None:
        bs = self.bm.block_size
        for pos in range(seq.num_tokens):
            slot = self.kv.get(seq.block_table[pos // bs], {}).get(pos % bs)
            assert slot == tuple(seq.token_ids[: pos + 1]), f"{seq.request_id}: bad KV at {pos}"


# -- properties -------------------------------------------------------------------------------

REQUEST = st.tuples(
    st.lists(st.integers(0, 1), min_size=1, max_size=20),  # prompt
    st.integers(1, 12),  # max_tokens
    st.integers(0, 6),  # arrival step
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    requests=st.lists(REQUEST, min_size=1, max_size=8),
    block_size=st.integers(1, 4),
    budget=st.integers(1, 24),
    max_num_seqs=st.integers(1, 6),
    extra_blocks=st.integers(0, 12) | st.integers(0, 2),  # a few: preemption
)
def test_every_request_finishes_with_its_tokens(
    requests: list[tuple[list[int], int, int]],
    block_size: int,
    budget: int,
    max_num_seqs: int,
    extra_blocks: int,
) -> None:
    alone = max(-(-(len(p) + m) // block_size) for p, m, _ in requests)  # each fits alone
    sim = Sim.new(alone + extra_blocks, block_size, max_num_seqs, budget)
    arrivals: dict[int, list[tuple[list[int], int]]] = {}
    for prompt, max_tokens, at in requests:
        arrivals.setdefault(at, []).append((prompt, max_tokens))
    sim.run(arrivals)
    sim.check_done()
    event(f"preemptions: {'some' if sim.scheduler.num_preemptions else 'none'}")
    assert sim.scheduler.num_preemptions == len(sim.preempted)


# -- examples ---------------------------------------------------------------------------------


def test_chunked_prefill_samples_once_at_the_end() -> None:
    sim = Sim.new(num_blocks=16, block_size=4, max_num_seqs=4, budget=5)
    seq = sim.add(list(range(23)), max_tokens=3)
    trace = []
    while sim.scheduler.has_unfinished:
        batch = sim.step()
        trace.append((batch.num_new_tokens[0], sim.sampled[-1][0]))
    assert trace == [(5, False)] * 4 + [(3, True), (1, True), (1, True)]
    assert seq.output_token_ids == fake_token_of(list(range(23)), 3)
    sim.check_done()


def fake_token_of(prompt: list[int], n: int) -> list[int]:
    s = Sequence("x", list(prompt), len(prompt), SamplingParams(), 0)
    for _ in range(n):
        s.token_ids.append(fake_token(s))
    return s.output_token_ids


def test_running_requests_are_served_before_waiting_ones() -> None:
    sim = Sim.new(num_blocks=16, block_size=4, max_num_seqs=4, budget=4)
    a = sim.add(list(range(10)), max_tokens=2)
    b = sim.add([7, 7], max_tokens=2)
    rows = []
    while sim.scheduler.has_unfinished:
        batch = sim.step()
        rows.append(
            [(s.request_id, n) for s, n in zip(batch.seqs, batch.num_new_tokens, strict=True)]
        )
    assert rows == [
        [("r0", 4)],
        [("r0", 4)],
        [("r0", 2), ("r1", 2)],  # b only gets what a leaves of the budget
        [("r0", 1), ("r1", 1)],
    ]
    assert a.is_finished and b.is_finished
    sim.check_done()


def test_max_num_seqs_caps_the_running_requests() -> None:
    sim = Sim.new(num_blocks=32, block_size=4, max_num_seqs=2, budget=100)
    for i in range(3):
        sim.add([i] * 3, max_tokens=2)
    rows = []
    while sim.scheduler.has_unfinished:
        rows.append([s.request_id for s in sim.step().seqs])
    assert rows == [["r0", "r1"], ["r0", "r1"], ["r2"], ["r2"]]
    sim.check_done()


def test_preemption_recomputes_the_newest_request_from_its_cached_prefix() -> None:
    # 6 blocks of 2: a and b hold 2 blocks each after their prompts; decoding needs more.
    sim = Sim.new(num_blocks=6, block_size=2, max_num_seqs=4, budget=64)
    a = sim.add([1, 2, 3, 4], max_tokens=6)
    b = sim.add([5, 6, 7, 8], max_tokens=6)
    trace = []
    while sim.scheduler.has_unfinished:
        batch = sim.step()
        rows = [(s.request_id, n) for s, n in zip(batch.seqs, batch.num_new_tokens, strict=True)]
        trace.append((rows, [s.request_id for s in batch.preempted]))
    assert trace == [
        ([("r0", 4), ("r1", 4)], []),
        ([("r0", 1), ("r1", 1)], []),
        ([("r0", 1), ("r1", 1)], []),
        ([("r0", 1)], ["r1"]),  # a needs a 4th block: b, the newest, gives back its three
        ([("r0", 1)], []),
        ([("r0", 1)], []),
        ([("r1", 5)], []),  # b again: 7 known tokens, its first block still cached
        ([("r1", 1)], []),
        ([("r1", 1)], []),
    ]
    assert b.num_cached_tokens == 2 and sim.bm.num_prefix_hit_blocks == 1
    assert sim.scheduler.num_preemptions == 1
    assert a.output_token_ids == fake_token_of([1, 2, 3, 4], 6)
    assert b.output_token_ids == fake_token_of([5, 6, 7, 8], 6)  # recompute keeps its tokens
    sim.check_done()


def test_request_longer_than_budget_alongside_decodes() -> None:
    sim = Sim.new(num_blocks=40, block_size=4, max_num_seqs=8, budget=6)
    short = sim.add([1, 2], max_tokens=5)
    sim.step()  # short's prefill
    long = sim.add(list(range(20)), max_tokens=1)
    steps = []
    while not long.is_finished:
        batch = sim.step()
        steps.append(
            {s.request_id: n for s, n in zip(batch.seqs, batch.num_new_tokens, strict=True)}
        )
    assert steps == [{"r0": 1, "r1": 5}, {"r0": 1, "r1": 5}, {"r0": 1, "r1": 5}, {"r0": 1, "r1": 5}]
    assert short.num_output_tokens == 5 and short.is_finished
    assert long.num_output_tokens == 1
    sim.check_done()


def test_a_prefill_only_row_in_its_reserved_blocks_is_passed_over_for_preemption() -> None:
    """A co-located worker's prefill row (joined prefill-only with the blocks its decode
    side reserved) needs no more blocks and hands them on in place: when a decode row
    needs one and none is free, the newest decode row is preempted instead, though the
    prefill row is newer."""
    bm = BlockManager(num_blocks=6, block_size=2)
    sch = Scheduler(SchedulerConfig(4, 64), bm)
    decoding = []
    for rid, prompt in (("a", [1, 2, 3, 4]), ("b", [5, 6, 7, 8])):
        seq = Sequence(rid, list(prompt), 4, SamplingParams(max_tokens=6), 0)
        sch.add(seq)
        decoding.append(seq)
    first = sch.schedule()
    assert [s.request_id for s in first.seqs] == ["a", "b"] and bm.num_free_blocks == 2
    for seq in decoding:  # their prompts computed, their first tokens sampled
        seq.num_computed_tokens = 4
        seq.token_ids.append(0)
    reserved = Sequence("c", [1, 1, 1, 1], 4, SamplingParams(max_tokens=6), 0)
    bm.allocate(reserved)  # what LLMEngine.reserve holds for it
    reserved.is_prefill_only = True
    sch.join(reserved)  # LLMEngine.prefill_reserved
    assert bm.num_free_blocks == 0
    batch = sch.schedule()  # a needs a third block
    assert [s.request_id for s in batch.preempted] == ["b"]
    rows = [(s.request_id, n) for s, n in zip(batch.seqs, batch.num_new_tokens, strict=True)]
    assert rows == [("a", 1), ("c", 4)]


def add_lora_request(sch: Scheduler, rid: str, lora: int, max_tokens: int) -> Sequence:
    seq = Sequence(rid, [1, 2, 3], 3, SamplingParams(max_tokens=max_tokens), 0)
    seq.lora_id = lora
    sch.add(seq)
    return seq


def run_step(sch: Scheduler, batch: ScheduledBatch) -> None:
    """The engine's part of a step, as ``Sim`` plays it: every row computes its tokens,
    samples where it caught up, and ends at max_tokens."""
    for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
        seq.num_computed_tokens += n
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(5)
            if seq.num_output_tokens >= seq.params.max_tokens:
                sch.finish(seq)


def test_at_most_max_loras_adapters_run_in_a_step_the_earliest_first() -> None:
    """Requests under adapters 0, 1, 0, none, 2, 1 with room for one adapter a step: each
    step runs one adapter and every request without one; the earliest requests' adapter
    goes first, the others sit steps out in their places, and all of them finish."""
    sch = Scheduler(SchedulerConfig(8, 64, max_loras=1), BlockManager(64, 4))
    seqs = [
        add_lora_request(sch, f"r{i}", lora, 2 + i % 2)
        for i, lora in enumerate([0, 1, 0, -1, 2, 1])
    ]
    order: list[tuple[str, ...]] = []
    while sch.has_unfinished:
        batch = sch.schedule()
        assert len({s.lora_id for s in batch.seqs if s.lora_id >= 0}) <= 1
        assert seqs[3] in batch.seqs or seqs[3].status is SequenceStatus.FINISHED
        order.append(tuple(s.request_id for s in batch.seqs))
        run_step(sch, batch)
    assert order[0] == ("r0", "r2", "r3")  # adapter 0 (r0's), and r3 without one
    assert [s.status for s in seqs] == [SequenceStatus.FINISHED] * 6
    # Adapter 1 (r1's, the next earliest), r5 with it, before adapter 2 (r4's).
    ids = ("r1", "r4", "r5")
    first = {rid: next(i for i, step in enumerate(order) if rid in step) for rid in ids}
    assert first["r1"] == first["r5"] < first["r4"]


def test_a_held_adapter_gets_its_turn_under_steady_traffic_for_another() -> None:
    """One adapter a step; r0 (adapter 0) then r1 (adapter 1), and a new adapter-0
    request every other step: once r0 is done, r1's adapter runs, ahead of the later
    adapter-0 requests, rather than waiting for that traffic to stop."""
    sch = Scheduler(SchedulerConfig(64, 256, max_loras=1), BlockManager(256, 4))
    r0, r1 = add_lora_request(sch, "r0", 0, 6), add_lora_request(sch, "r1", 1, 3)
    first_r1 = None
    for step in range(60):
        if step % 2 == 0:
            add_lora_request(sch, f"a{step}", 0, 4)
        batch = sch.schedule()
        assert len({s.lora_id for s in batch.seqs}) <= 1
        if r1 in batch.seqs and first_r1 is None:
            first_r1 = step
        run_step(sch, batch)
    assert r0.status is SequenceStatus.FINISHED
    assert first_r1 is not None and first_r1 <= 7  # r0's 6 steps, then r1's turn
    assert r1.status is SequenceStatus.FINISHED

"""Continuous batching under one rule: a request's computed tokens catch up with its known tokens.

A fresh prompt, a prefill chunk and a decode step are the same thing here: a request
with ``num_tokens - num_computed_tokens`` tokens to compute, served within the step's
token budget. Running requests go first; waiting ones are admitted while blocks and
budget last. When blocks run out, the newest running request is preempted by
recompute: its blocks are freed and it waits again, keeping the tokens it has.

At most ``max_loras`` LoRA adapters run in one step: those of the earliest requests,
running or waiting, so that a request's adapter gets its turn once the requests before
it do. A request under another adapter sits the step out (running, its blocks kept; or
waiting, its place kept). Requests without an adapter are never held back by it.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field

from engine.dp_blocks import KvBlocks
from engine.sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64  # rows per step
    max_num_batched_tokens: int = 1024  # tokens per step; long prompts are chunked to fit
    max_loras: int | None = None  # LoRA adapters per step; None: no bound

    def __post_init__(self) -> None:
        if self.max_loras is not None and self.max_loras < 1:
            raise ValueError(f"max_loras: must be >= 1, got {self.max_loras}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs: must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens: must be >= 1, got {self.max_num_batched_tokens}"
            )


@dataclass
class ScheduledBatch:
    """What the scheduler hands the model runner for one step."""

    seqs: list[Sequence] = field(default_factory=list)  # the rows, in order
    num_new_tokens: list[int] = field(default_factory=list)  # tokens each row computes now
    preempted: list[Sequence] = field(default_factory=list)  # sent back to waiting this step

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def samples(self, row: int) -> bool:
        """Whether row ``row`` catches up with its known tokens and so samples a new one."""
        seq = self.seqs[row]
        return seq.num_computed_tokens + self.num_new_tokens[row] == seq.num_tokens


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: KvBlocks) -> None:
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self._arrivals = itertools.count()

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        seq.arrival = next(self._arrivals)
        self.waiting.append(seq)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.config.max_num_batched_tokens
        adapters = self._step_adapters()

        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:  # preempted by an earlier row
                continue
            if not self._takes_adapter(seq, adapters):
                continue
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.block_manager.can_append(seq, num_new):
                victim = self._victim(seq)
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                continue
            self.block_manager.append(seq, num_new)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(num_new)
            budget -= num_new

        held: list[Sequence] = []  # waiting under an adapter not in this step
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if batch.preempted:
                break
            if not self._takes_adapter(seq, adapters):
                held.append(self.waiting.popleft())
                continue
            if not self.block_manager.can_allocate(seq):
                break
            self.waiting.popleft()
            self.block_manager.allocate(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(num_new)
            budget -= num_new
        self.waiting.extendleft(reversed(held))  # in their places, ahead of the rest
        return batch

    def _step_adapters(self) -> set[int] | None:
        """The LoRA adapters this step runs: those of the earliest requests, running or
        waiting, up to ``max_loras``; None: any."""
        limit = self.config.max_loras
        pending = [*self.running, *self.waiting]
        if limit is None or all(seq.lora_id < 0 for seq in pending):
            return None
        chosen: set[int] = set()
        for seq in sorted(pending, key=lambda s: s.arrival):
            if seq.lora_id >= 0 and len(chosen) < limit:
                chosen.add(seq.lora_id)
        return chosen

    @staticmethod
    def _takes_adapter(seq: Sequence, adapters: set[int] | None) -> bool:
        """Whether ``seq`` runs in this step as far as its adapter goes."""
        return adapters is None or seq.lora_id < 0 or seq.lora_id in adapters

    def finish(self, seq: Sequence) -> None:
        """Releases a finished or aborted request's blocks and forgets it."""
        if seq in self.running:
            self.running.remove(seq)
            self.block_manager.free(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED

    def detach(self, seq: Sequence) -> None:
        """Takes a running request out of the batch but leaves it its blocks (a prefill
        worker keeps them until the KV has been sent)."""
        self.running.remove(seq)

    def join(self, seq: Sequence) -> None:
        """Adds a request whose KV is already in its blocks (a decode worker, after the
        transfer) straight to the running batch."""
        seq.status = SequenceStatus.RUNNING
        seq.arrival = next(self._arrivals)
        self.running.append(seq)

    def _victim(self, needing: Sequence) -> Sequence:
        """The newest running request whose blocks ``needing`` could use (under
        data-parallel attention, one of its rank's), passing over prefill-only ones while
        there are others: on a co-located worker, such a row computes a prompt into blocks
        it was reserved, needs no more and hands them to decoding in place; handed back,
        it would leave its prefill side nothing to hand over."""
        pool = [s for s in self.running if s.dp_rank == needing.dp_rank]
        decoding = [s for s in pool if not s.is_prefill_only]
        return (decoding or pool)[-1]

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.num_cached_tokens = 0
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

"""Overlap scheduling of speculative decode steps: step n+1 is launched before step n's
tokens are read, so that the host's postprocessing of step n (tokens, stop checks,
detokenization) and its scheduling of step n+2 run while the device runs step n+1.

Rows of step n that go on into step n+1 take their inputs from step n's outputs on the
device: pending token = its ``next_tokens``, drafts = its ``next_draft_tokens``, KV length
= its KV length + ``num_accepted`` + 1. The host reads step n's tokens from pinned memory
(``PendingStep``) once step n+1 is launched. Because step n's accepted counts are unknown
when step n+1 is scheduled, a row's blocks are grown for the worst case (K+1 new tokens);
a row that may reach ``max_tokens`` at step n is not launched again until step n is read
(its step n+1 could overflow its context); a row that ends at step n (EOS, stop token or
string, error, abort) has its step n+1 tokens discarded, and its blocks are freed once
step n+1 has been read (the device may still write them until then).

Rows that need the host between steps (a grammar, logprobs, penalties or logit bias) are
not covered: the engine reads the step in flight first and runs the step as without
overlap. Each row's tokens are the same either way.

Each step verifies the drafts its rows have (the fewest of any row, as without overlap:
a row of the step in flight has the ones that step proposes) and proposes ``k_next``: the
runner's K, or with adaptive speculation the K chosen for each step launched
(``SpecRunner.launch_depth``), so that the next step verifies it. A steady K runs one
captured graph per K; the step where K changes (verifying the old K, proposing the new)
runs uncaptured, launched ahead all the same. Acceptance is observed as each step is
read, one step late; step costs are not (overlapped steps have no time of their own). A
K = 0 step runs the drafter rather than deferring it (``SpecRunner.defer_drafter`` is off
with overlap: a row the host has to catch up could not be launched ahead).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from engine.dp_blocks import KvBlocks
from engine.sampler import SamplingTensors
from engine.sequence import Sequence, SequenceStatus
from engine.spec.graph_runner import PendingStep
from engine.spec.spec_runner import DecodeResult, SpecRunner
from engine.spec.unified_step import SpecStepInputs

CPU = torch.device("cpu")


@dataclass(eq=False)
class AheadStep:
    """A launched decode step whose tokens the host has not read yet."""

    seqs: list[Sequence]  # its rows, in order
    k: int  # drafts verified per row
    k_next: int  # drafts proposed per row: what its rows' next step verifies at most
    kv_lens: torch.Tensor  # [B] int64 device: each row's KV length (pending position)
    pending: PendingStep  # outputs on the device, tokens on their way to the host
    # Rows of this step that go on into the next one, launched before this one is read.
    continuing: list[Sequence] = field(default_factory=list)
    # Rows that ended before this step was read: their blocks are freed once it is.
    free_after: list[Sequence] = field(default_factory=list)

    def holds(self, seq: Sequence) -> bool:
        return any(s is seq for s in self.seqs)

    def may_launch(self, seq: Sequence) -> bool:
        """Whether ``seq`` may be in the step launched before this one is read."""
        return not self.holds(seq) or any(s is seq for s in self.continuing)


def can_overlap(seq: Sequence) -> bool:
    """Whether a running row's steps can be launched before the previous step is read:
    nothing in it needs the host between steps."""
    p = seq.params
    return (
        seq.grammar is None
        and p.logprobs is None
        and not p.uses_penalties
        and seq.draft_probs is None
        and p.speculative  # a row of K = 0 among rows of K: the eager step's padding
        and not seq.undrafted_features
    )


def may_continue(seq: Sequence, k: int) -> bool:
    """Whether a row of a step in flight verifying ``k`` drafts may be launched again before
    that step is read: it is running and cannot reach max_tokens there (K+1 tokens)."""
    return (
        seq.status is SequenceStatus.RUNNING
        and seq.num_output_tokens + k + 1 < seq.params.max_tokens
    )


def reserve(blocks: KvBlocks, running: list[Sequence], step: AheadStep) -> bool:
    """Grows the tables of ``step``'s rows that may continue for their worst case (K+1
    tokens accepted in ``step``, then one more step), if the free blocks hold that and what
    every other running row needs now; False (nothing reserved) when they do not: the
    engine then reads ``step`` first, and may preempt as usual (never a row in flight)."""
    continuing = [s for s in step.seqs if may_continue(s, step.k)]
    grow = {id(s): step.k + 2 for s in continuing}  # n + K + 1 is the next pending position
    needed = 0
    for seq in running:
        num_new = grow.get(id(seq), seq.num_tokens - seq.num_computed_tokens)
        total = seq.num_computed_tokens + num_new + blocks.num_lookahead_slots
        needed += max(0, blocks.num_blocks_for(total) - len(seq.block_table))
    if needed > blocks.num_free_blocks:
        return False
    for seq in continuing:
        blocks.append(seq, step.k + 2)
    step.continuing = continuing
    return True


@torch.inference_mode()
def launch(
    spec: SpecRunner, seqs: list[Sequence], prev: AheadStep | None, k_next: int
) -> AheadStep:
    """Launches one decode step over ``seqs`` that verifies the drafts they have (the
    fewest of any row) and proposes ``k_next``: rows of ``prev`` (launched, not read) take
    their inputs from its outputs on the device, the others from their host state. Nothing
    here waits for the device."""
    assert spec.graphs is not None
    device = spec.runner.device
    where = {id(s): i for i, s in enumerate(prev.seqs)} if prev is not None else {}
    rows = [where.get(id(s), -1) for s in seqs]  # the row in ``prev``, or -1
    reach = prev.k + 1 if prev is not None else 0  # positions a row of ``prev`` may advance
    prev_drafts = prev.k_next if prev is not None else 0
    k = min(
        len(s.draft_token_ids or []) if r < 0 else prev_drafts
        for s, r in zip(seqs, rows, strict=True)
    )

    def t(values: list[int] | list[list[int]]) -> torch.Tensor:
        return to_device(torch.tensor(values, dtype=torch.int64), device)

    # Host values; rows of ``prev`` hold placeholders, replaced on the device below.
    tokens = t([s.token_ids[-1] for s in seqs])  # [B]
    own = [
        (s.draft_token_ids or [])[:k] if r < 0 else [0] * k for s, r in zip(seqs, rows, strict=True)
    ]
    drafts = t(own).view(len(seqs), k)  # [B, K]
    kv_lens = t([s.num_computed_tokens for s in seqs])  # [B]
    if prev is not None and max(rows) >= 0:
        out = prev.pending.outputs  # valid until its graph runs again: gathered before that
        src = t([max(r, 0) for r in rows])
        is_prev = t([int(r >= 0) for r in rows]).bool()
        tokens = torch.where(is_prev, out.next_tokens[src], tokens)
        drafts = torch.where(is_prev[:, None], out.next_draft_tokens[src, :k], drafts)
        kv_lens = torch.where(is_prev, (prev.kv_lens + out.num_accepted + 1)[src], kv_lens)
    bound = max(
        s.num_computed_tokens + (reach if r >= 0 else 0) for s, r in zip(seqs, rows, strict=True)
    )
    width = max(len(s.block_table) for s in seqs)
    host = SamplingTensors.build(  # no penalties (can_overlap); positions are not read
        [s.params for s in seqs], [s.seed for s in seqs], [s.num_tokens for s in seqs], CPU
    )
    sampling = dataclasses.replace(
        host,
        temperature=to_device(host.temperature, device),
        top_k=to_device(host.top_k, device),
        top_p=to_device(host.top_p, device),
        min_p=to_device(host.min_p, device),
        seeds=to_device(host.seeds, device),
        positions=to_device(host.positions, device),
    )
    inputs = SpecStepInputs(
        tokens=tokens,
        draft_tokens=drafts,
        kv_lens=kv_lens,
        block_tables=t([s.block_table + [0] * (width - len(s.block_table)) for s in seqs]),
        sampling=sampling,
        max_context_len=spec._context_bound(bound, k, k_next),
    )
    return AheadStep(seqs, k, k_next, kv_lens, spec.graphs.launch(inputs, k_next))


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` on ``device`` without waiting for the work in flight there: a copy from
    pageable memory to CUDA waits for the stream; one from pinned memory does not."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def read(spec: SpecRunner, step: AheadStep) -> list[DecodeResult | None]:
    """Waits for ``step``'s tokens; per row, what it emitted, or None for a row that ended
    (or was aborted) while the step ran: its tokens are discarded. Counts the rows kept."""
    num_accepted, emitted, drafts = (x.tolist() for x in step.pending.host())
    results: list[DecodeResult | None] = []
    kept: list[int] = []
    for i, seq in enumerate(step.seqs):
        if seq.status is not SequenceStatus.RUNNING:
            results.append(None)
            continue
        a = num_accepted[i]
        kept.append(a)
        seq.spec_counts.record(step.k, a)
        seq.draft_token_ids = drafts[i]  # the next step's (already launched if it goes on)
        results.append(DecodeResult(emitted[i][: a + 1], None))
    spec.stats.record(step.k, kept)
    if spec.adaptive is not None:
        spec.adaptive.observe(step.k, kept)
    return results

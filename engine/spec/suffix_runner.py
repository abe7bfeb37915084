"""Speculation with suffix decoding's drafts (engine.spec.suffix): no draft model, no draft
KV; each decode step verifies what each row's match proposes.

Rows propose different numbers of tokens, from none (no match) to K. Where they differ,
the step packs each row's pending token and its own drafts into one ragged batch
(``SpecStepInputs.packed_lengths``), so it costs the tokens proposed, not the longest
proposal times the rows. With adaptive speculation, ``DraftSelector`` (engine.spec.
draft_select) cuts each row's proposal where its tokens' estimated chance of acceptance no
longer pays for what verifying them costs, priced at the measured cost of a step of that
many tokens; without it, every proposed token is verified.

Proposals are made on the host before the step, from the tokens the rows already hold,
so the step runs eagerly (its rows' lengths differ from step to step): no CUDA graph, and
no overlap scheduling.
"""

from __future__ import annotations

import time

import torch

from engine.model_runner import ModelRunner, StepOutput
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledBatch
from engine.sequence import FinishReason, Sequence
from engine.spec.config import SpeculativeConfig
from engine.spec.draft_select import DraftSelector
from engine.spec.spec_runner import DecodeResult, SpecRunner
from engine.spec.suffix import Proposal, SuffixProposer


class SuffixSpecRunner(SpecRunner):
    def __init__(self, config: SpeculativeConfig, runner: ModelRunner, num_blocks: int) -> None:
        super().__init__(config, runner, None, num_blocks)
        self.proposer = SuffixProposer(config.suffix)
        self.defer_drafter = False  # nothing to defer: there is no drafter
        self.selector = DraftSelector()  # with adaptive speculation: what each row verifies

    @torch.inference_mode()
    def prefill(self, batch: ScheduledBatch) -> StepOutput:
        """The target's prefill; each row that sampled its first token decodes from now on
        (its drafts are proposed at each step)."""
        self._decode_ended = None
        result = self.runner.execute(batch)
        for row in result.rows:
            batch.seqs[row].draft_token_ids, batch.seqs[row].draft_probs = [], None
        return result

    @torch.inference_mode()
    def warm_up(self, scratch_blocks: list[int]) -> None:
        """Compiles the verify steps that the warm-up's generations may not reach (their
        prompts repeat one token: few matches) before a request needs them: rows of
        different draft lengths (packed) and of the same (traced at 3 rows, each serves
        every batch from 2 on), and one row of drafts whose block table is more than a
        block wide (bench/RESULTS.md: with K fixed, it compiled in a request's step)."""
        if not scratch_blocks:
            return
        bs, width = self.runner.block_size, 2 * self.k + 8
        per_row = max(2, -(-(width + self._scratch_slots()) // bs))
        blocks = torch.tensor(scratch_blocks, dtype=torch.int64)
        for lengths in ([self.k, 0, 1], [1, self.k, 0, 2], [self.k] * 3, [self.k]):
            tables = blocks[torch.arange(len(lengths) * per_row) % len(blocks)]
            self.time_scratch_step(
                tables.view(len(lengths), per_row),
                self.k,
                width,
                SamplingParams(max_tokens=1),
                packed_lengths=lengths if len(set(lengths)) > 1 else None,
            )

    def forget(self) -> None:
        super().forget()
        self.proposer = SuffixProposer(self.config.suffix)
        self.selector = DraftSelector()

    def finished(self, seq: Sequence) -> None:
        """A request's output, for the shared index: what later requests may repeat."""
        if seq.finish_reason in (FinishReason.STOP, FinishReason.LENGTH):
            self.proposer.finished(seq.output_token_ids)

    def propose(self, seq: Sequence) -> Proposal:
        """Up to K tokens after ``seq``'s pending one, from its own tokens or the shared
        index; none for a request that does not speculate."""
        if not seq.params.speculative:
            return Proposal.empty()
        if seq.suffix_index is None:
            seq.suffix_index = self.proposer.request_index(seq.token_ids)
        return self.proposer.propose(seq.suffix_index, self.k)

    @torch.inference_mode()
    def decode(self, seqs: list[Sequence]) -> list[DecodeResult]:
        """One verify step over rows whose target KV covers all but their pending token."""
        proposals = [self.propose(s) for s in seqs]
        lengths = [len(p.tokens) for p in proposals]
        started = time.perf_counter()  # proposing is the same work at every K: overhead
        context = sum(s.num_computed_tokens for s in seqs) / len(seqs)
        if self.adaptive is not None:
            if self._decode_ended is not None:
                self.adaptive.observe_overhead(len(seqs), started - self._decode_ended, context)
            if any(lengths):
                lengths = self.selector.select(self.adaptive, len(seqs), context, proposals)
        k = max(lengths, default=0)
        for seq, proposal, n in zip(seqs, proposals, lengths, strict=True):
            seq.draft_token_ids = proposal.tokens[:n]
        inputs = self._step_inputs(seqs, k, 0, lengths)
        if min(lengths, default=k) < k:  # each row verifies its own drafts only
            inputs.packed_lengths = lengths
        inputs.return_logits = any(s.params.logprobs is not None for s in seqs)
        self._verify_under_adapters(seqs, inputs)
        out = self.step(inputs, 0)
        num_accepted, emitted = out.num_accepted.tolist(), out.emitted.tolist()  # completed
        self.stats.record_rows(k, lengths, num_accepted)
        for seq, a, n in zip(seqs, num_accepted, lengths, strict=True):
            seq.spec_counts.record(n, a)
        if self.adaptive is not None:
            self.selector.observe(proposals, lengths, num_accepted)
            depth = sum(lengths) / len(lengths)  # what the step cost: its tokens
            self.adaptive.observe_cost(len(seqs), depth, time.perf_counter() - started, context)
        logprobs = self._logprobs(seqs, out.logits, out.emitted)
        results = []
        for i, seq in enumerate(seqs):
            seq.draft_token_ids = []  # the next step proposes anew
            tokens = emitted[i][: num_accepted[i] + 1]
            results.append(DecodeResult(tokens, None if logprobs is None else logprobs[i]))
        self._decode_ended = time.perf_counter()
        return results

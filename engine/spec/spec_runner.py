"""Runs speculative decoding for the engine: draft prefill after target prefill, then the
unified step for decode rows, with counters and (optionally) adaptive K."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from engine.kv_cache import KVCacheParams, PagedKVCache
from engine.model_runner import ModelRunner, RowLogprobs, StepOutput, row_lora_groups
from engine.sampler import SamplingTensors, top_logprobs
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledBatch
from engine.sequence import Sequence
from engine.spec.adaptive import AdaptiveK, CostRefresh, StepCost, measure_costs
from engine.spec.config import SpeculativeConfig
from engine.spec.dp_draft import name_ranks
from engine.spec.drafters import Drafter, ProposeArgs, load_drafter
from engine.spec.grammar import StepGrammar, step_fields
from engine.spec.graph_runner import (
    PersistentInputBuffers,
    StepGraphRunner,
    StepShape,
    blocks_per_seq,
)
from engine.spec.stats import SpecDecodeStats
from engine.spec.unified_step import SpecStepInputs, UnifiedStep

logger = logging.getLogger(__name__)


@dataclass
class DecodeResult:
    tokens: list[int]  # emitted this step: accepted drafts, then the next token
    logprobs: list[RowLogprobs] | None  # one per emitted token, when asked for


def load_speculator(
    config: SpeculativeConfig, target: nn.Module, device: torch.device, target_dir: str
) -> Drafter | None:
    """The draft model; None for a kind that drafts without one (suffix decoding). MTP
    reads its layer from the target's files (``target_dir``)."""
    if config.is_model_free:
        return None
    if config.reads_target_files:
        from engine.spec.drafters.mtp import load_mtp

        return load_mtp(target_dir, target, device)
    return load_drafter(config.draft_model, target, device, config.kind, config.target_layer_ids)  # type: ignore[arg-type]


def num_draft_tokens(config: SpeculativeConfig, drafter: Drafter | None) -> int:
    fixed = drafter.fixed_num_draft_tokens if drafter is not None else None
    return fixed or config.num_draft_tokens


def num_lookahead_slots(k: int, drafter: Drafter | None) -> int:
    """Slots past a row's next token that a step may write: verify up to n+K, drafts up to
    n+K+max(K, block) (rejected positions are overwritten later); without a draft model,
    verify alone."""
    if drafter is None:
        return k + 2
    return k + max(k, drafter.fixed_num_draft_tokens or 0) + 2


class SpecRunner:
    """Speculative decoding for the engine, over its ``ModelRunner``: after a prompt's
    target prefill, the drafter's (``prefill``); then for decode rows one unified step
    each (``decode``: verify the drafts, accept, propose the next), with K chosen per step
    when adaptive (``AdaptiveK``, from costs measured at start-up). Subclassed by
    ``SuffixSpecRunner``, whose drafts come from no model."""

    def __init__(
        self,
        config: SpeculativeConfig,
        runner: ModelRunner,
        drafter: Drafter | None,  # None: drafts without a model (SuffixSpecRunner)
        num_blocks: int,
        draft_kv: PagedKVCache | None = None,  # None: made here (a split draft's: its heads)
    ) -> None:
        self.config, self.runner, self.drafter = config, runner, drafter
        self.k = num_draft_tokens(config, drafter)
        self.draft_kv: PagedKVCache | None = draft_kv
        if drafter is not None and draft_kv is None:
            params = KVCacheParams.from_config(drafter.config, runner.block_size)
            self.draft_kv = PagedKVCache(params, num_blocks, runner.device)
        self.step = UnifiedStep(
            runner.executor.compiled_forward(),
            drafter,
            runner.kv_cache,
            self.draft_kv,
            runner.backend,
            acceptance=config.acceptance,
            synthetic_rates=config.synthetic_acceptance_rates,
            sample_drafts=config.sample_drafts,
            sampling_kernels=runner.sampling_kernels,
        )
        self.stats = SpecDecodeStats()
        self.adaptive: AdaptiveK | None = None
        self.refresh: CostRefresh | None = None  # with adaptive: stale buckets timed again
        # A step that drafts nothing leaves the drafter idle and keeps the target features;
        # the drafter catches up in one batched extend when drafting resumes, or when a row
        # has kept ``max_undrafted`` positions (the features' memory stays bounded). False
        # runs it every step (what deferring saves: bench/RESULTS.md).
        self.defer_drafter = True
        self.max_undrafted = 256
        # When the last decode step ended, if nothing but the engine's own bookkeeping ran
        # since (a prefill resets it): the gap to the next decode step is overhead every K
        # pays, which adaptive K adds to its step costs.
        self._decode_ended: float | None = None
        self.graphs: StepGraphRunner | None = None  # decode steps through CUDA graphs

    def enable_graphs(self, max_batch: int, max_model_len: int, scratch_block: int) -> None:
        """Decode steps of up to ``max_batch`` rows at this runner's K (with adaptive
        speculation, at each K up to it), greedy or sampled, through CUDA graphs (elsewhere
        the same padded path, uncaptured); padded rows write ``scratch_block``, a block no
        request owns."""
        k, device = self.k, self.runner.device
        bound = max_model_len + num_lookahead_slots(k, self.drafter) + 1  # _context_bound's
        width = blocks_per_seq(bound, self.runner.block_size)
        buffers = PersistentInputBuffers.alloc(
            max_batch, max_batch * (k + 1), device, max_blocks_per_seq=width
        )
        self.graphs = StepGraphRunner(
            self.step, buffers, scratch_block, peers=self.runner.executor.graph_peers
        )
        # Sampled drafts' probabilities are kept across steps: not as a graph's outputs.
        modes = (True,) if self.config.sample_drafts else (True, False)
        depths = range(k + 1) if self.config.adaptive else (k,)  # adaptive: a graph per K
        self.graphs.capture(
            [
                StepShape(d, d, d == 0 and self.defer_drafter, greedy, False)
                for d in depths
                for greedy in modes
            ]
        )

    # -- prefill -----------------------------------------------------------------------

    @torch.inference_mode()
    def prefill(self, batch: ScheduledBatch) -> StepOutput:
        """Target prefill with the drafter's features, draft KV for the same positions, and
        K drafts for rows that sampled their first token."""
        self._decode_ended = None
        result = self._prefill(batch)
        if result.kv_step is not None and self.draft_kv is not None:  # every layer written
            executor = self.runner.executor
            if executor.gathers("draft"):  # the draft's KV at the target's positions
                assert result.inputs is not None
                executor.gather_kv("draft", result.inputs.layout.slot_mapping)
            for layer in range(len(self.draft_kv.layers)):
                self.runner.notify_layer("draft", layer, step=result.kv_step)
        return result

    def _prefill(self, batch: ScheduledBatch) -> StepOutput:
        assert self.drafter is not None and self.draft_kv is not None
        result = self.runner.execute(batch, self.drafter.target_hidden)
        name_ranks(self.drafter, (seq.dp_rank for seq in batch.seqs))
        inputs, out = result.inputs, result.outputs
        assert inputs is not None and out is not None
        sampled = dict(zip(result.rows, result.tokens, strict=True))
        shifted: list[int] = []  # the token after each computed position
        for row, (seq, num_new) in enumerate(zip(batch.seqs, batch.num_new_tokens, strict=True)):
            start = seq.num_computed_tokens
            shifted += seq.token_ids[start + 1 : start + num_new]
            # A FAULT row's (-1) draft KV and drafts are never used: any id will do.
            after = sampled[row] if row in sampled else seq.token_ids[start + num_new]
            shifted.append(max(after, 0))
        device = self.runner.device
        state = self.drafter.extend(
            torch.tensor(shifted, dtype=torch.int64, device=device),
            self.drafter.features(out),
            inputs.layout,
            result.metadata,
            self.draft_kv.layers,
            self.runner.backend,
        )
        if not result.rows:
            return result
        seqs = [batch.seqs[r] for r in result.rows]
        offsets = inputs.input_row_offsets
        rows = torch.tensor(result.rows, dtype=torch.int64, device=device)
        last_positions = [
            s.num_computed_tokens + batch.num_new_tokens[r] - 1
            for r, s in zip(result.rows, seqs, strict=True)
        ]
        k = self.k
        if self.adaptive is not None:
            k = self.adaptive.choose(len(seqs), sum(last_positions) / len(last_positions))
        args = ProposeArgs(
            last_index=offsets[rows + 1] - 1,
            last_positions=torch.tensor(last_positions, dtype=torch.int64, device=device),
            next_tokens=result.sampled.clamp(min=0),  # type: ignore[union-attr]
            block_tables=inputs.layout.block_tables[rows],
            block_size=self.runner.block_size,
            max_context_len=self._context_bound(max(last_positions), 0, k),
        )
        sampling = self._sampling(seqs, penalties=False)
        drafts, probs = self.step.propose(state, args, sampling, k, StepGrammar.of(seqs))
        for i, (seq, row_drafts) in enumerate(zip(seqs, drafts.tolist(), strict=True)):
            if seq.params.speculative:
                seq.draft_token_ids = row_drafts
                seq.draft_probs = None if probs is None else probs[i]
            else:  # its steps verify none; the drafter still writes its draft KV
                seq.draft_token_ids, seq.draft_probs = [], None
        return result

    @property
    def kind(self) -> str:
        """What drafts: the draft model's kind, or the model-free method's."""
        return self.drafter.kind if self.drafter is not None else str(self.config.kind)

    def warm_up(self, scratch_blocks: list[int]) -> None:
        """After the engine's warm-up: compiles what its requests may not have reached."""

    def forget(self) -> None:
        """Drops what runs so far taught it (the engine's warm-up's): counters, outputs."""
        self.stats = SpecDecodeStats()

    def finished(self, seq: Sequence) -> None:
        """``seq`` ended with its output final; a drafter that learns from outputs (suffix
        decoding's shared index) takes it here."""

    # -- decode ------------------------------------------------------------------------

    @torch.inference_mode()
    def decode(self, seqs: list[Sequence]) -> list[DecodeResult]:
        """One unified step over rows whose target KV covers all but their pending token."""
        started = time.perf_counter()
        # The batch verifies as deep as its shallowest speculating row; a request that does
        # not speculate has none, and its row is padding past its pending token.
        speculating = [len(s.draft_token_ids or []) for s in seqs if s.params.speculative]
        k = min(speculating, default=0)
        lengths = [k if s.params.speculative else 0 for s in seqs]
        k_next, context = (self.k if speculating else 0), 0.0  # context: mean KV length
        if self.adaptive is not None and speculating:
            context = sum(s.num_computed_tokens for s in seqs) / len(seqs)
            if self._decode_ended is not None:
                self.adaptive.observe_overhead(len(seqs), started - self._decode_ended, context)
            k_next = self.adaptive.choose(len(seqs), context)
        defer = k_next == 0 and self.defer_drafter
        behind = [
            s
            for s in seqs
            if s.undrafted_features and (not defer or s.num_undrafted_tokens >= self.max_undrafted)
        ]
        if behind:
            self._catch_up(behind)
            if self.adaptive is not None:  # a cost of having left the drafter idle
                self.adaptive.charge(time.perf_counter() - started)
            started = time.perf_counter()
        inputs = self._step_inputs(seqs, k, k_next, lengths)
        self._verify_under_adapters(seqs, inputs)
        name_ranks(self.drafter, (seq.dp_rank for seq in seqs))
        if (
            self.graphs is not None and inputs.grammar is None and inputs.draft_lengths is None
        ):  # one wait, for the tokens' pinned host copies
            pending = self.graphs.launch(inputs, k_next, defer_drafter=defer)
            out, host = pending.outputs, pending.host()
        else:
            out = self.step(inputs, k_next, defer_drafter=defer)
            host = (out.num_accepted, out.emitted, out.next_draft_tokens)
        num_accepted, emitted, drafts = (t.tolist() for t in host)  # completed: time it
        verifying = [a for a, n in zip(num_accepted, lengths, strict=True) if n == k]
        self.stats.record_rows(k, lengths, num_accepted)
        for seq, a, n in zip(seqs, num_accepted, lengths, strict=True):
            seq.spec_counts.record(n, a)
        if self.adaptive is not None and speculating:  # a batch that chose its K
            self.adaptive.observe(k, verifying)
            if k == k_next:  # a step at one depth, as the costs are measured
                self.adaptive.observe_cost(len(seqs), k, time.perf_counter() - started, context)
        logprobs = self._logprobs(seqs, out.logits, out.emitted)
        committed = None  # per row, the features of positions n..n+accepted
        if out.features is not None:  # one packed copy, not a copy per row
            steps = torch.arange(out.features.shape[1], device=out.features.device)
            kept = out.features[steps[None, :] <= out.num_accepted[:, None]]
            committed = kept.split([a + 1 for a in num_accepted])
        results = []
        for i, seq in enumerate(seqs):
            if seq.params.speculative:
                seq.draft_token_ids = drafts[i]
                probs = out.next_draft_probs
                seq.draft_probs = None if probs is None else probs[i]
            else:
                seq.draft_token_ids, seq.draft_probs = [], None
            if committed is not None:
                seq.defer_drafting(committed[i])
            tokens = emitted[i][: num_accepted[i] + 1]
            results.append(DecodeResult(tokens, None if logprobs is None else logprobs[i]))
        self._decode_ended = time.perf_counter()
        return results

    def _verify_under_adapters(self, seqs: list[Sequence], inputs: SpecStepInputs) -> None:
        """Rows under LoRA adapters verify under them; drafts stay the base model's."""
        if self.runner.lora_step is None:
            return
        k, packed = inputs.draft_tokens.shape[1], inputs.packed_lengths
        per_row = [k + 1] * len(seqs) if packed is None else [1 + n for n in packed]
        groups = row_lora_groups(seqs, per_row)
        offsets, ids = groups.get("lora_grouped_offsets", []), groups.get("lora_ids", [])
        self.runner.use_lora_groups(offsets, ids)

    def launch_depth(self, seqs: list[Sequence]) -> int:
        """Overlap scheduling: the drafts that a step launched over ``seqs`` proposes (its
        rows' next step verifies them): K, or chosen per step with adaptive speculation."""
        if self.adaptive is None or not seqs:
            return self.k
        context = sum(s.num_computed_tokens for s in seqs) / len(seqs)
        return self.adaptive.choose(len(seqs), context)

    def _catch_up(self, seqs: list[Sequence]) -> None:
        """Writes the draft KV that steps without drafts left out, in one ragged extend over
        each row's undrafted positions (up to its pending token, which the step verifies)."""
        assert self.drafter is not None and self.draft_kv is not None
        spans = [(seq, seq.num_drafted_tokens, seq.num_computed_tokens) for seq in seqs]
        layout = self.runner.layout(spans)
        name_ranks(self.drafter, (seq.dp_rank for seq in seqs))
        # Feature i pairs with the token after it, up to the pending token at ``end``.
        tokens = [t for seq, start, end in spans for t in seq.token_ids[start + 1 : end + 1]]
        backend = self.runner.backend
        self.drafter.extend(
            torch.tensor(tokens, dtype=torch.int64, device=self.runner.device),
            torch.cat([f for seq in seqs for f in seq.undrafted_features]),
            layout,
            backend.build_metadata(layout),
            self.draft_kv.layers,
            backend,
        )
        for seq in seqs:
            seq.clear_undrafted()
        self.stats.num_caught_up_positions += len(tokens)

    def _step_inputs(
        self, seqs: list[Sequence], k: int, k_next: int, lengths: list[int] | None = None
    ) -> SpecStepInputs:
        """``lengths``: each row's drafts (k, or 0 for a request that does not speculate);
        None: k for every row."""
        device = self.runner.device

        def t(values: list[int] | list[list[int]]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        kv_lens = [s.num_computed_tokens for s in seqs]
        width = max(len(s.block_table) for s in seqs)
        lengths = lengths if lengths is not None else [k] * len(seqs)
        drafts = [
            (s.draft_token_ids or [])[:n] + [0] * (k - n)
            for s, n in zip(seqs, lengths, strict=True)
        ]
        draft_probs = None
        real = [s for s, n in zip(seqs, lengths, strict=True) if n > 0]
        if self.config.sample_drafts and real and all(s.draft_probs is not None for s in real):
            probs = [s.draft_probs[:k] for s in real]
            empty = probs[0].new_zeros(probs[0].shape)  # padding rows: q = 0, never read
            draft_probs = torch.stack(
                [s.draft_probs[:k] if n > 0 else empty for s, n in zip(seqs, lengths, strict=True)]
            )
        return SpecStepInputs(
            tokens=t([s.token_ids[-1] for s in seqs]),
            draft_tokens=t(drafts).view(len(seqs), k),
            kv_lens=t(kv_lens),
            block_tables=t([s.block_table + [0] * (width - len(s.block_table)) for s in seqs]),
            sampling=self._sampling(seqs),
            max_context_len=self._context_bound(max(kv_lens), k, k_next),
            draft_probs=draft_probs,
            draft_lengths=t(lengths) if min(lengths, default=k) < k else None,
            dp_ranks=t([s.dp_rank for s in seqs]) if self.runner.data_parallel_size > 1 else None,
            **step_fields(seqs, drafts, device, self.runner.mask_worker),  # rows with a grammar
        )

    def _context_bound(self, position: int, k: int, k_next: int) -> int:
        """Host bound on the KV length of a step from ``position`` (the pending token, or the
        last prompt token at prefill) that verifies ``k`` drafts and proposes ``k_next``:
        verify reaches position + k, the drafts at most k + max(k_next, block) further."""
        fixed = self.drafter.fixed_num_draft_tokens if self.drafter is not None else None
        return position + k + max(k_next, fixed or 0) + 3

    def _sampling(self, seqs: list[Sequence], *, penalties: bool = True) -> SamplingTensors:
        """Per-row parameters; ``penalties`` False for draft proposals, which go without."""
        return SamplingTensors.build(
            [s.params for s in seqs],
            [s.seed for s in seqs],
            [s.num_tokens for s in seqs],
            self.runner.device,
            [s.token_ids for s in seqs] if penalties else None,
            [s.num_prompt_tokens for s in seqs] if penalties else None,
        )

    def _logprobs(
        self, seqs: list[Sequence], logits: torch.Tensor, emitted: torch.Tensor
    ) -> list[list[RowLogprobs]] | None:
        if all(s.params.logprobs is None for s in seqs):
            return None
        b, s, v = logits.shape
        n = max(seq.params.logprobs or 0 for seq in seqs)
        chosen, ids, values = top_logprobs(logits.view(b * s, v), emitted.clamp(min=0).view(-1), n)
        rows = list(zip(chosen.tolist(), ids.tolist(), values.tolist(), strict=True))
        return [rows[i * s : (i + 1) * s] for i in range(b)]

    # -- adaptive K --------------------------------------------------------------------

    @torch.inference_mode()  # as the steps run: a compiled step's graphs are the same
    def enable_adaptive(
        self, max_batch: int, scratch_blocks: list[int], max_context: int
    ) -> dict[int, dict[int, StepCost]]:
        """Measures a step cost line per batch bucket and K on scratch blocks (free at
        start-up) at a short and a long context. Rows share the blocks where there are too
        few for each its own: what the KV holds does not change what a step costs. Later,
        ``refresh`` times buckets again whose steps run at longer contexts."""
        slots = self._scratch_slots()
        long = max(1, min(512, max_context - slots))
        contexts = (min(32, long), long)
        buckets = [b for b in (1, 2, 4, 8, 16, 24, 32, 48, 64) if b <= max_batch] or [1]
        choices = list(range(self.k + 1))
        started = time.perf_counter()
        costs = measure_costs(self._scratch_steps(scratch_blocks), buckets, choices, contexts)
        logger.info(
            "adaptive speculation: step costs of batch buckets %s, K up to %d, at contexts %s, "
            "measured in %.1f s",
            buckets,
            self.k,
            contexts,
            time.perf_counter() - started,
        )
        self.adaptive = AdaptiveK(choices, costs, measured_context=contexts[1])
        self.refresh = CostRefresh(self.adaptive, max(1, max_context - slots))
        return costs

    def refresh_costs(self, free_blocks: list[int]) -> float:
        """An idle engine's turn: times one K of a stale bucket on ``free_blocks`` (blocks
        no request holds nor a cached prefix), within the refresh's budget; seconds taken."""
        if self.refresh is None or not free_blocks or not self.refresh.is_wanted():
            return 0.0
        return self.refresh.run_one(self._scratch_steps(free_blocks))

    def _scratch_slots(self) -> int:
        return num_lookahead_slots(self.k, self.drafter) + self.k + 2

    def _scratch_steps(self, scratch_blocks: list[int]) -> Callable[[int, int, int], float]:
        """(batch, K, context) -> seconds of one step on ``scratch_blocks``, as decode runs
        it (K = 0 defers the drafter where decode would)."""
        bs, slots = self.runner.block_size, self._scratch_slots()
        blocks = torch.tensor(scratch_blocks, dtype=torch.int64)

        def run_step(b: int, k: int, context: int) -> float:
            per_row = -(-(context + slots) // bs)
            tables = blocks[torch.arange(b * per_row) % len(blocks)].view(b, per_row)
            return self.time_scratch_step(
                tables,
                k,
                context,
                SamplingParams(max_tokens=1),
                defer_drafter=k == 0 and self.defer_drafter,  # as decode runs K=0
            )

        return run_step

    @torch.inference_mode()
    def time_scratch_step(
        self,
        tables: torch.Tensor,  # [B, M] scratch blocks, enough for context + 2K + 3 slots
        k: int,
        context: int,
        params: SamplingParams,
        *,
        defer_drafter: bool = False,
        packed_lengths: list[int] | None = None,
    ) -> float:
        """Seconds of one unified step of B rows at KV length ``context`` that verifies k
        (zero) drafts and proposes k (``defer_drafter``, with k = 0: a plain step); what
        the KV holds does not change its cost. ``packed_lengths``: a packed verify of that
        many drafts per row (a step without a drafter)."""
        b = tables.shape[0]
        device = self.runner.device
        lengths = None
        if packed_lengths is not None:
            lengths = torch.tensor(packed_lengths, dtype=torch.int64, device=device)
        inputs = SpecStepInputs(
            tokens=torch.zeros(b, dtype=torch.int64, device=device),
            draft_tokens=torch.zeros(b, k, dtype=torch.int64, device=device),
            kv_lens=torch.full((b,), context, dtype=torch.int64, device=device),
            block_tables=tables.to(device),
            sampling=SamplingTensors.build([params] * b, [0] * b, [context] * b, device),
            max_context_len=self._context_bound(context, k, self.k),
            draft_lengths=lengths,
            packed_lengths=packed_lengths,
        )
        if self.runner.data_parallel_size > 1:  # rows over the ranks, as requests spread
            inputs.dp_ranks = torch.arange(b, device=device) % self.runner.data_parallel_size
            name_ranks(self.drafter, inputs.dp_ranks.tolist())
        self.runner.use_lora_groups([], [])  # scratch rows: the base model's
        start = time.perf_counter()
        self.step(inputs, k, defer_drafter=defer_drafter)
        return time.perf_counter() - start

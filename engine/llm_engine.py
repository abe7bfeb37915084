"""The engine loop: schedule, run, postprocess, one step at a time."""

from __future__ import annotations

import dataclasses
import functools
import gc
import logging
import secrets
from collections.abc import Set as AbstractSet
from typing import Any

import torch

from engine.admission import RequestError, check_request
from engine.components import build_components
from engine.disaggregation import Disaggregation
from engine.engine_config import EngineConfig
from engine.kv_cache import KVCacheCapacityError
from engine.lora.adapter import LoraAdapter, LoraError
from engine.lora.registry import LoraMismatch, LoraNotLoaded, LoraRegistry
from engine.model_runner import StepOutput
from engine.output_processor import OutputProcessor
from engine.outputs import RequestDelta, RequestOutput, hand_out
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledBatch
from engine.sequence import FinishReason, Sequence, SequenceStatus
from engine.spec import overlap
from engine.spec.overlap import AheadStep
from engine.spec.spec_runner import DecodeResult
from engine.stop_checker import StopChecker
from engine.warm_up import warm_up

logger = logging.getLogger(__name__)


class LLMEngine(Disaggregation):
    """One model on one device, or split over tensor-parallel ranks (``engine.executor``),
    serving many requests: ``add_request`` queues one,
    ``step`` runs one scheduled batch (prefill chunks and decode rows together, through
    the ``ModelRunner``, or the ``SpecRunner`` with a draft) and returns the outputs of
    the requests that produced tokens. Disaggregated, a prefill worker adds requests
    prefill-only and hands their blocks on (``take_prefilled``); a decode worker
    ``reserve``s blocks for a pushed KV, and ``start_decoding`` joins the request to the
    batch. Not thread-safe: one thread (a service's engine thread) calls everything.

    ``step_deltas`` is the step a service runs: what it added to each request, which the
    service assembles into outputs (text, stop strings) off this thread. ``step`` is the
    offline one: it assembles them itself (``engine.output_processor``)."""

    def __init__(self, config: EngineConfig, tokenizer: Any | None = None) -> None:
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.config = config
        self.device = torch.device(config.device)
        self.tokenizer = tokenizer
        parts = build_components(config, tokenizer)
        self.model_config = parts.model_config
        self.max_model_len = parts.model_config.max_seq_len
        self.grammars = parts.grammars
        self.kv_cache = parts.kv_cache
        self.whole_kv_cache = parts.whole_kv_cache
        self.whole_draft_kv = parts.whole_draft_kv
        self.block_manager = parts.block_manager
        self.scheduler = parts.scheduler
        self.kernels = parts.kernels
        self.runner = parts.runner
        self.spec = parts.spec
        self.loras = parts.loras  # LoRA adapters a request may name; None: none ever
        self._seqs: dict[str, Sequence] = {}
        self.stops = StopChecker(parts.eos_token_ids)
        self._new_seed = functools.partial(secrets.randbits, 63)
        self._offline_outputs = OutputProcessor(tokenizer)  # step()'s
        self._ahead: AheadStep | None = None  # overlap scheduling: the step in flight
        self.num_steps_ahead = 0  # decode steps launched before the previous one was read
        try:
            if config.torch_compile or config.warm_up:
                warm_up(self)
            # After the warm-up: the costs of compiled steps, not of compiling them.
            if self.spec is not None and config.speculative and config.speculative.adaptive:
                self.spec.enable_adaptive(
                    config.max_num_seqs, list(range(parts.num_blocks)), self.max_model_len
                )
        except BaseException:
            self.close()  # the other ranks, if any
            raise
        # Loading and compiling leave about a million long-lived objects (modules, graphs,
        # guards, symbolic shapes) that every full collection scans: one took 1.2 s in the
        # middle of a decode step (SmolLM2 compiled, batch 8, 10% of a benchmark run). They
        # live as long as the engine (reference counts free them with it): keep them out of
        # the cyclic collector, as serving engines do once started.
        gc.collect()
        gc.freeze()

    def close(self) -> None:
        """Stops the other tensor-parallel ranks, if any (an engine never closed stops them
        when its interpreter exits)."""
        self.runner.executor.close()

    @property
    def lora_names(self) -> dict[str, tuple[int, int]]:
        """The LoRA adapters a request may name: name -> (id, digest of its files)."""
        return self.loras.names if self.loras is not None else {}

    def load_lora(self, name: str, path: str, adapter: LoraAdapter | None = None) -> None:
        """Loads LoRA adapter ``name`` from ``path`` (PEFT's files) between steps, or puts
        in ``adapter``, which ``read_lora`` read from there; LoraError (a ValueError
        naming the field) for one this engine cannot serve."""
        self._registry().load(name, path, self._num_requests_under, adapter)

    def read_lora(self, name: str, path: str) -> LoraAdapter:
        """LoRA adapter ``name`` read from ``path`` and checked, for ``load_lora``; from any
        thread (the files are read while the engine steps)."""
        return self._registry().read(name, path)

    def _registry(self) -> LoraRegistry:
        if self.loras is None:
            raise LoraError(
                "lora_name: this engine runs no LoRA adapters (start it with lora_modules "
                "or enable_lora)"
            )
        return self.loras

    def unload_lora(self, name: str) -> None:
        """Unloads LoRA adapter ``name``; LoraError while requests run under it."""
        if self.loras is None:
            raise LoraNotLoaded(f"lora_name: {name!r} is not loaded; this engine runs no adapters")
        self.loras.unload(name, self._num_requests_under)

    def _num_requests_under(self, slot: int) -> int:
        return sum(seq.lora_id == slot for seq in self._seqs.values())

    @property
    def eos_token_ids(self) -> AbstractSet[int]:
        return self.stops.eos_token_ids

    # -- requests ----------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        is_prefill_only: bool = False,
        num_output_tokens_sent: int = 0,
        lora: str | None = None,
        lora_digest: int | None = None,
    ) -> None:
        """Queues a request. ``is_prefill_only`` (a prefill worker): stop after the first
        token and keep the blocks until ``drop_request``; ``take_prefilled`` returns the
        result. ``num_output_tokens_sent``: the last ids of ``prompt_token_ids`` are output
        an earlier attempt generated and sent (a preempted request resumed); they count
        towards max_tokens, and its first delta's start has them (for stop strings).
        ``lora``: the name of one of the engine's LoRA adapters to run it under;
        ``lora_digest``: its digest as a worker's router saw it (LoraMismatch if this
        engine's adapter of that name is not that one, or is gone)."""
        seq = self._new_sequence(
            request_id, prompt_token_ids, params, num_output_tokens_sent, lora, lora_digest
        )
        seq.is_prefill_only = is_prefill_only
        self.scheduler.add(seq)

    def _new_sequence(
        self,
        request_id: str,
        token_ids: list[int],
        params: SamplingParams,
        num_output_tokens_sent: int = 0,
        lora: str | None = None,
        lora_digest: int | None = None,
    ) -> Sequence:
        if lora is not None and lora not in self.lora_names and lora_digest is None:
            raise RequestError(
                f"lora: {lora!r} is not an adapter of this engine; adapters: "
                f"{sorted(self.lora_names)}"
            )
        limit = min(len(token_ids), params.max_tokens)
        if num_output_tokens_sent < 0 or (
            num_output_tokens_sent and num_output_tokens_sent >= limit
        ):
            raise RequestError(
                f"num_output_tokens_sent: {num_output_tokens_sent}, must be at least 0 and below "
                f"both the number of ids ({len(token_ids)}) and max_tokens ({params.max_tokens})"
            )
        num_prompt_tokens = len(token_ids) - num_output_tokens_sent
        if request_id in self._seqs:
            raise RequestError(f"request_id: {request_id!r} is already running")
        check_request(
            token_ids,
            params,
            num_prompt_tokens,
            vocab_size=self.model_config.vocab_size,
            has_tokenizer=self.tokenizer is not None,
            max_model_len=self.max_model_len,
            block_manager=self.block_manager,
        )
        seed = params.seed if params.seed is not None else self._new_seed()
        seq = Sequence(
            request_id=request_id,
            token_ids=list(token_ids),
            num_prompt_tokens=num_prompt_tokens,
            params=params,
            seed=seed,
            num_tokens_handed_out=len(token_ids),  # the prompt, and output already sent
        )
        if lora is not None:  # before any block hash: they chain on the adapter's digest
            if self.loras is None:
                raise LoraMismatch(f"model: this worker has no adapter {lora!r}")
            seq.lora_id, seq.cache_salt = self.loras.use(
                lora, self._num_requests_under, lora_digest
            )
        seq.grammar = self.grammars.row(params.structured_output, token_ids[num_prompt_tokens:])
        self._seqs[request_id] = seq
        return seq

    def drop_request(self, request_id: str, *, stopped_after: int | None = None) -> None:
        """Ends a request here, whatever its state. ``stopped_after``: its holder found a
        stop string after that many output tokens (resumed ones included), so it ended
        as a finished one does: a drafter that learns from outputs takes it, cut there."""
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return
        if stopped_after is not None and seq.finish_reason is None and self.spec is not None:
            cut = seq.token_ids[: seq.num_prompt_tokens + stopped_after]
            stopped = dataclasses.replace(seq, token_ids=cut, finish_reason=FinishReason.STOP)
            self.spec.finished(stopped)
        if seq.status in (SequenceStatus.RESERVED, SequenceStatus.PREFILLED):
            self.block_manager.free(seq)
            seq.status = SequenceStatus.FINISHED
        else:
            self._free_blocks(seq)
        self._offline_outputs.forget(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished or self._ahead is not None

    def wants_cost_refresh(self) -> bool:
        """Adaptive speculation has step costs to time again (``refresh_costs``)."""
        refresh = self.spec.refresh if self.spec is not None else None
        has_room = self.block_manager.num_clean_blocks > 0  # else it would wait for none
        return refresh is not None and has_room and refresh.is_wanted()

    def stop_cost_refresh(self) -> None:
        if self.spec is not None:
            self.spec.refresh = None

    def refresh_costs(self) -> float:
        """While no request runs: times one K of a bucket whose steps ran at longer contexts
        than its costs were measured at, on free blocks (engine.spec.adaptive.CostRefresh);
        seconds taken, 0 when there was nothing to do."""
        if self.spec is None or self.has_unfinished_requests():
            return 0.0
        return self.spec.refresh_costs(self.block_manager.clean_block_ids)

    # -- the loop ----------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Offline (one thread adds, steps and reads): runs one step; returns the outputs
        of the requests it changed, assembled here. A request that a stop string ended
        is dropped at once."""
        outputs = self._offline_outputs.process(self.step_deltas())
        for output in outputs:
            seq = self._seqs.get(output.request_id)
            if output.finished and seq is not None and seq.finish_reason is None:
                # A stop string, which the engine does not see.
                self.drop_request(output.request_id, stopped_after=len(output.token_ids))
        return outputs

    def step_deltas(self) -> list[RequestDelta]:
        """Runs one engine step; returns the deltas of the requests it changed."""
        if self.config.enable_overlap_scheduler:
            return self._step_ahead()
        return self._step_now()

    def _step_now(self) -> list[RequestDelta]:
        """Schedules, runs and postprocesses one step, reading its tokens at once."""
        batch = self.scheduler.schedule()
        outputs = self._hand_back(batch) if self.config.preemption == "hand_back" else []
        if not batch.seqs:
            return self._idle(outputs)
        if self.spec is None:
            return outputs + self._postprocess(batch, self.runner.execute(batch))
        prefill, decode = self._split(batch)
        if prefill.seqs:
            outputs += self._postprocess(prefill, self.spec.prefill(prefill))
        if decode:
            outputs += self._postprocess_spec(decode, self.spec.decode(decode))
        return outputs

    def _step_ahead(self) -> list[RequestDelta]:
        """Overlap scheduling (engine.spec.overlap): launches the next decode step, then
        reads the one launched before it. Steps it does not cover run as ``_step_now``, once
        the step in flight is read."""
        assert self.spec is not None
        prev, self._ahead = self._ahead, None
        running = self.scheduler.running
        if not all(overlap.can_overlap(s) for s in running) or (
            prev is not None and not overlap.reserve(self.block_manager, running, prev)
        ):
            return self._read_ahead(prev) + self._step_now()
        batch = self.scheduler.schedule()  # reserve() left no running row short of blocks
        outputs = self._hand_back(batch) if self.config.preemption == "hand_back" else []
        if not batch.seqs and prev is None:
            return self._idle(outputs)
        prefill, decode = self._split(batch)
        if prefill.seqs:
            outputs += self._postprocess(prefill, self.spec.prefill(prefill))
        decode = [s for s in decode if prev is None or prev.may_launch(s)]
        if decode:
            self._ahead = overlap.launch(self.spec, decode, prev, self.spec.launch_depth(decode))
            self.num_steps_ahead += prev is not None and bool(prev.continuing)
        return outputs + self._read_ahead(prev)

    def _read_ahead(self, step: AheadStep | None) -> list[RequestDelta]:
        """Postprocesses a launched step's rows that are still running, once its tokens are
        on the host, and frees the blocks of rows that ended while it ran."""
        if step is None:
            return []
        assert self.spec is not None
        results = overlap.read(self.spec, step)
        for seq in step.free_after:
            self.block_manager.free(seq)
        kept = [(s, r) for s, r in zip(step.seqs, results, strict=True) if r is not None]
        return self._postprocess_spec([s for s, _ in kept], [r for _, r in kept])

    def _idle(self, outputs: list[RequestDelta]) -> list[RequestDelta]:
        """A step with nothing scheduled: only the requests it handed back, if any."""
        if not outputs and self.scheduler.waiting and not self.scheduler.running:
            raise KVCacheCapacityError(
                f"kv cache: the next request does not fit in an idle cache "
                f"({self.block_manager.num_free_blocks} of {self.block_manager.num_blocks} "
                "blocks free); blocks were not returned, which is a bug"
            )
        return outputs

    def _split(self, batch: ScheduledBatch) -> tuple[ScheduledBatch, list[Sequence]]:
        """The rows that prefill (or compute several tokens), and the speculative decode rows."""
        for seq in batch.preempted:  # recomputed from scratch, draft KV included
            seq.draft_token_ids, seq.draft_probs = None, None
            seq.clear_undrafted()
        decode = {i for i in range(len(batch.seqs)) if self._is_spec_decode(batch, i)}
        prefill = ScheduledBatch(
            [s for i, s in enumerate(batch.seqs) if i not in decode],
            [n for i, n in enumerate(batch.num_new_tokens) if i not in decode],
        )
        return prefill, [batch.seqs[i] for i in sorted(decode)]

    def _hand_back(self, batch: ScheduledBatch) -> list[RequestDelta]:
        """Ends the requests this step preempted (their blocks are already free) with
        FinishReason.PREEMPTED: whoever sent them resumes them elsewhere."""
        outputs = []
        for seq in batch.preempted:
            self.scheduler.finish(seq)  # out of the waiting queue
            seq.finish_reason = FinishReason.PREEMPTED
            outputs.append(hand_out(seq, has_spec=self.spec is not None))
            self._seqs.pop(seq.request_id, None)
        batch.preempted.clear()
        return outputs

    def _is_spec_decode(self, batch: ScheduledBatch, row: int) -> bool:
        """Rows whose only new token is the pending one and that hold drafts."""
        seq = batch.seqs[row]
        return (
            seq.draft_token_ids is not None
            and batch.num_new_tokens[row] == 1
            and batch.samples(row)
        )

    def _postprocess_spec(
        self, seqs: list[Sequence], results: list[DecodeResult]
    ) -> list[RequestDelta]:
        outputs = []
        for seq, result in zip(seqs, results, strict=True):
            # Target KV now covers the pending token and every accepted draft.
            seq.num_computed_tokens += len(result.tokens)
            for i, token in enumerate(result.tokens):
                row = result.logprobs[i] if result.logprobs is not None else None
                self.stops.append(seq, token, row)
                if seq.finish_reason is not None:
                    break
            self.block_manager.cache_computed_blocks(seq, seq.num_drafted_tokens)
            outputs.append(hand_out(seq, has_spec=self.spec is not None))
            if seq.finish_reason is not None:
                self._finish(seq)
        return outputs

    def _finish(self, seq: Sequence) -> None:
        if self.spec is not None:
            self.spec.finished(seq)
        self._free_blocks(seq)
        del self._seqs[seq.request_id]

    def _free_blocks(self, seq: Sequence) -> None:
        """Ends a request in the scheduler; a step in flight may still write its blocks:
        they are freed once that step is read."""
        ahead = self._ahead
        if ahead is None or seq.status is not SequenceStatus.RUNNING or not ahead.holds(seq):
            self.scheduler.finish(seq)
            return
        self.scheduler.detach(seq)
        seq.status = SequenceStatus.FINISHED
        ahead.free_after.append(seq)

    def _postprocess(self, batch: ScheduledBatch, result: StepOutput) -> list[RequestDelta]:
        for row, entries in result.prompt_logprobs or ():
            seq = batch.seqs[row]  # entries for prompt tokens from num_computed_tokens + 1 on
            seq.prompt_logprobs[seq.num_computed_tokens :] = entries  # a recompute overwrites
        for seq, num_new in zip(batch.seqs, batch.num_new_tokens, strict=True):
            seq.num_computed_tokens += num_new
            self.block_manager.cache_computed_blocks(seq)
        outputs = []
        for i, (row, token) in enumerate(zip(result.rows, result.tokens, strict=True)):
            seq = batch.seqs[row]
            if seq.params.max_tokens == 0:  # prompt logprobs only: the token is dropped
                seq.finish_reason = FinishReason.LENGTH
            else:
                row_logprobs = result.logprobs[i] if result.logprobs is not None else None
                self.stops.append(seq, token, row_logprobs)
            outputs.append(hand_out(seq, has_spec=self.spec is not None))
            if seq.is_prefill_only:
                # Blocks stay until drop_request(), even when the first token ended it: a layer
                # listener's transfer may still be reading this step's KV from them.
                self.scheduler.detach(seq)
                seq.status = SequenceStatus.PREFILLED
            elif seq.finish_reason is not None:
                self._finish(seq)
        return outputs

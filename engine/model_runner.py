"""Turns a scheduled batch into model inputs, runs the forward and samples."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from engine import prompt_logprobs
from engine.attention.base import AttentionBackend, BatchLayout
from engine.dp_blocks import whole_ids
from engine.executor.inputs import ForwardInputs
from engine.executor.multiproc import MultiprocExecutor, RankGroup
from engine.executor.uniproc import UniprocExecutor, compile_decode_model
from engine.kv_cache import PagedKVCache
from engine.lora.layers import LoraStep
from engine.models.llama3 import NO_HIDDEN_STATES, ModelOutputs, ReturnHiddenStates
from engine.sampler import SamplingTensors, sample, top_logprobs
from engine.sampling_kernels import TORCH_SAMPLING, SamplingKernels
from engine.scheduler import ScheduledBatch
from engine.sequence import Sequence, TokenLogprobs
from engine.structured.rows import SamplingMasks, active_rows, commit_rows


@dataclass
class ModelInputs:
    """One step's ragged batch, on the model's device."""

    tokens: torch.Tensor  # [T] int64
    input_row_offsets: torch.Tensor  # [B+1] int64
    layout: BatchLayout
    logit_indices: torch.Tensor  # [N * n] int64: last n tokens of each row that samples
    sample_rows: list[int]  # host: which rows those are
    dp_ranks: torch.Tensor | None = None  # [B] int64: each row's data-parallel rank
    # LoRA: runs of rows under one adapter, as token offsets [G + 1], and their adapters.
    lora_grouped_offsets: list[int] = field(default_factory=list)
    lora_ids: list[int] = field(default_factory=list)


RowLogprobs = tuple[float, list[int], list[float]]  # chosen token's, top-n ids, top-n values


@dataclass(frozen=True)
class RowKv:
    """Where one row of a step writes its KV: positions ``[start, end)`` of the request, in
    the slots of ``block_table`` (a copy: the request's table as the step saw it)."""

    request_id: str
    start: int
    end: int
    block_table: tuple[int, ...]
    is_last: bool  # the row samples: its known tokens are all computed (a prompt's last chunk)


@dataclass(frozen=True)
class StepKv:
    """The KV one step writes, row by row; handed to a ``LayerListener``."""

    rows: tuple[RowKv, ...]

    @classmethod
    def of(cls, batch: ScheduledBatch, blocks_per_rank: int = 0) -> StepKv:
        """``blocks_per_rank``: under data-parallel attention, each rank's blocks, which a
        pool of every rank's numbers one rank after another (engine.dp_blocks.whole_table)."""
        return cls(
            tuple(
                RowKv(
                    seq.request_id,
                    seq.num_computed_tokens,
                    seq.num_computed_tokens + num_new,
                    tuple(whole_ids(seq.block_table, seq.dp_rank, blocks_per_rank)),
                    batch.samples(row),
                )
                for row, (seq, num_new) in enumerate(
                    zip(batch.seqs, batch.num_new_tokens, strict=True)
                )
            )
        )


# (pool "target" or "draft", layer, step): that layer's KV of the step is written. Called in
# the engine's thread; on a GPU the layer's kernels are only queued then (a listener records
# an event on the current stream and its reader waits for it). Must not block.
LayerListener = Callable[[str, int, StepKv], None]


def _told_after_gathering(layer: int) -> None:
    """A forward's ``on_layer`` where the ranks' KV is whole only after it (gathered to
    rank 0's copy, or written by data-parallel ranks, which finish every layer before the
    logits' gather): nothing yet (it still marks the forward as a listened one: eager, as
    every prefill's)."""


@dataclass
class StepOutput:
    rows: list[int]  # batch rows that sampled a token
    tokens: list[int]  # the sampled token per such row
    logprobs: list[RowLogprobs] | None
    # What a drafter needs to follow the target (set when hidden states were asked for).
    inputs: ModelInputs | None = None
    metadata: Any = None
    outputs: ModelOutputs | None = None
    sampled: torch.Tensor | None = None  # [N] the sampled tokens, on the device
    kv_step: StepKv | None = None  # what the layer listener was told (None without one)
    # (row, entries of the prompt tokens after this step's positions) per row asking for them.
    prompt_logprobs: list[tuple[int, list[TokenLogprobs]]] | None = None


def lora_groups(batch: ScheduledBatch) -> dict[str, list[int]]:
    """The batch's runs of consecutive rows under one LoRA adapter (or none), as token
    offsets and adapter ids; empty where no row has an adapter."""
    return row_lora_groups(batch.seqs, batch.num_new_tokens)


def row_lora_groups(seqs: list[Sequence], tokens_per_row: list[int]) -> dict[str, list[int]]:
    """``lora_groups`` of rows of ``tokens_per_row`` tokens each (a speculative step's)."""
    if all(seq.lora_id < 0 for seq in seqs):
        return {}
    offsets: list[int] = [0]
    ids: list[int] = []
    for seq, num_new in zip(seqs, tokens_per_row, strict=True):
        if ids and ids[-1] == seq.lora_id:
            offsets[-1] += num_new
        else:
            ids.append(seq.lora_id)
            offsets.append(offsets[-1] + num_new)
    return {"lora_grouped_offsets": offsets, "lora_ids": ids}


class ModelRunner:
    """The target model's forward over a scheduled batch: ``prepare`` lays the batch out
    as ``ModelInputs`` (packed rows, ``input_row_offsets``, block tables), ``forward``
    runs it against the paged KV cache through an attention backend, and ``execute``
    samples each row's next token (with logprobs, penalties and grammar masks where its
    request asks). It knows nothing of requests' lifetimes: the engine's scheduler and
    block manager decide what runs."""

    def __init__(
        self,
        model: nn.Module,
        kv_cache: PagedKVCache,
        backend: AttentionBackend,
        device: torch.device,
        *,
        compile_decode: bool = False,
        cpp_wrapper: bool = False,  # compiled through inductor's C++ wrapper
        sampling_kernels: SamplingKernels = TORCH_SAMPLING,
        ranks: RankGroup | None = None,
        data_parallel_size: int = 1,
    ) -> None:
        self.model = model
        # The adapters' token groups of each forward (engine.lora); None: no adapters.
        self.lora_step: LoraStep | None = getattr(model, "lora_step", None)
        self.data_parallel_size = data_parallel_size  # rows name their rank where over 1
        self.sampling_kernels = sampling_kernels  # where filters and draws run
        # What decode steps call: the model, or its compiled form (engine.executor.uniproc).
        self.decode_model: nn.Module = model
        if compile_decode:
            self.decode_model = compile_decode_model(model, kv_cache, cpp_wrapper=cpp_wrapper)
        self.kv_cache = kv_cache
        self.backend = backend
        self.device = device
        # Where the forward runs: here, or on every tensor-parallel rank (``ranks``).
        self.executor: UniprocExecutor = UniprocExecutor(
            model, kv_cache, backend, self.decode_model
        )
        if ranks is not None:
            self.executor = MultiprocExecutor(ranks, model, kv_cache, backend, self.decode_model)
        self.block_size = kv_cache.params.block_size
        # Told of each target layer of every ``execute`` (prefill workers push KV from it).
        self.layer_listener: LayerListener | None = None
        # Fills grammar rows' masks while the forward runs (a thread only once used).
        self.mask_worker = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")

    def prepare(self, batch: ScheduledBatch, return_n_logits: int = 1) -> ModelInputs:
        """Builds the step's inputs; rows that sample get logits for their last
        ``return_n_logits`` tokens (speculative verification needs K+1 per row)."""
        spans = [
            (seq, seq.num_computed_tokens, seq.num_computed_tokens + num_new)
            for seq, num_new in zip(batch.seqs, batch.num_new_tokens, strict=True)
        ]
        layout = self.layout(spans)
        offsets = [0, *itertools.accumulate(batch.num_new_tokens)]
        sample_rows = [row for row in range(len(batch.seqs)) if batch.samples(row)]
        return ModelInputs(
            tokens=self._tensor([t for seq, start, end in spans for t in seq.token_ids[start:end]]),
            input_row_offsets=layout.input_row_offsets,
            layout=layout,
            logit_indices=self._tensor(
                [
                    i
                    for r in sample_rows
                    for i in range(
                        max(offsets[r], offsets[r + 1] - return_n_logits), offsets[r + 1]
                    )
                ]
            ),
            sample_rows=sample_rows,
            dp_ranks=(
                self._tensor([seq.dp_rank for seq in batch.seqs])
                if self.data_parallel_size > 1
                else None
            ),
            **lora_groups(batch),
        )

    def layout(self, spans: list[tuple[Sequence, int, int]]) -> BatchLayout:
        """The layout of a ragged batch: row b computes positions ``start:end`` of its
        sequence (``spans[b]``), reading and writing KV through its block table."""
        bs = self.block_size
        positions: list[int] = []
        slots: list[int] = []
        offsets = [0]
        for seq, start, end in spans:
            positions.extend(range(start, end))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            offsets.append(offsets[-1] + end - start)
        context_lens = [end for _, _, end in spans]
        query_lens = [end - start for _, start, end in spans]
        width = max(len(seq.block_table) for seq, _, _ in spans)
        tables = [seq.block_table + [0] * (width - len(seq.block_table)) for seq, _, _ in spans]
        return BatchLayout(
            input_row_offsets=self._tensor(offsets),
            positions=self._tensor(positions),
            slot_mapping=self._tensor(slots),
            context_lens=self._tensor(context_lens),
            block_tables=self._tensor(tables),
            block_size=bs,
            max_query_len=max(query_lens),
            max_context_len=max(context_lens),
            is_causal_prefill=all(start == 0 for _, start, _ in spans),
            query_lens=query_lens,
            context_lens_host=context_lens,
        )

    def _tensor(self, values: list[int] | list[list[int]]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.device)

    def forward(
        self,
        inputs: ModelInputs,
        return_hidden_states: ReturnHiddenStates = NO_HIDDEN_STATES,
        metadata: Any = None,
        on_layer: Callable[[int], None] | None = None,
    ) -> ModelOutputs:
        # Decode rows only (one token each) run the compiled forward; speculative
        # verification calls it itself. Prompt chunks stay eager: each query length would
        # be a graph of its own, for work whose small ops matter less.
        is_decode = inputs.layout.max_query_len == 1 and on_layer is None
        self.use_lora_groups(inputs.lora_grouped_offsets, inputs.lora_ids)
        forward = ForwardInputs(
            inputs.tokens,
            inputs.layout,
            inputs.logit_indices,
            return_hidden_states,
            metadata,
            on_layer,
            inputs.dp_ranks,
        )
        return self.executor.forward(forward, compiled=is_decode)

    def use_lora_groups(self, offsets: list[int], ids: list[int]) -> None:
        """The next forward's LoRA token groups (``row_lora_groups``'); none: no adapter."""
        if self.lora_step is not None:
            self.lora_step.set(offsets, ids)

    def notify_layer(self, pool: str, layer: int, *, step: StepKv) -> None:
        """Tells the listener that ``layer`` of ``pool`` is written for ``step``."""
        if self.layer_listener is not None:
            self.layer_listener(pool, layer, step)

    @torch.inference_mode()
    def execute(
        self, batch: ScheduledBatch, return_hidden_states: ReturnHiddenStates = NO_HIDDEN_STATES
    ) -> StepOutput:
        inputs = self.prepare(batch)
        seqs = [batch.seqs[r] for r in inputs.sample_rows]
        grammars = active_rows(seqs)
        # Filled while the forward runs; greedy rows' after it, where the argmax is refused.
        masks = SamplingMasks(grammars, self.mask_worker, [s.params for s in seqs])
        metadata = self.backend.build_metadata(inputs.layout)
        step = None
        if self.layer_listener is not None:
            per_rank = self.kv_cache.num_blocks if self.data_parallel_size > 1 else 0
            step = StepKv.of(batch, per_rank)
        on_layer: Callable[[int], None] | None = None
        gathers = step is not None and self.executor.gathers("target")
        told_after = gathers or self.data_parallel_size > 1
        if step is not None:
            on_layer = functools.partial(self.notify_layer, "target", step=step)
            if told_after:  # every rank's KV is in the pool only after the forward
                on_layer = _told_after_gathering
        # Rows asking for prompt logprobs get logits at their prompt positions too, after
        # the sampling rows' (the lm_head over every prompt position only where asked).
        spans = prompt_logprobs.prompt_spans(batch)
        num_sample = len(inputs.logit_indices)
        if spans:
            extra = self._tensor(prompt_logprobs.logit_indices(spans))
            inputs.logit_indices = torch.cat([inputs.logit_indices, extra])
        out = self.forward(inputs, return_hidden_states, metadata, on_layer)
        if gathers:  # (engine.executor.gathered_kv)
            self.executor.gather_kv("target", inputs.layout.slot_mapping)
        if step is not None and told_after:
            for layer in range(len(self.kv_cache.layers)):
                self.notify_layer("target", layer, step=step)
        prompt = None
        if spans:
            prompt = prompt_logprobs.collect(batch, spans, out.logits[num_sample:])
            out.logits = out.logits[:num_sample]
            inputs.logit_indices = inputs.logit_indices[:num_sample]
        if not inputs.sample_rows:  # only prefill chunks that do not reach the end
            return StepOutput(
                [], [], None, inputs, metadata, out, kv_step=step, prompt_logprobs=prompt
            )
        logits = masks.apply(out.logits)  # [N, V]
        tensors = SamplingTensors.build(
            [s.params for s in seqs],
            [s.seed for s in seqs],
            [s.num_tokens for s in seqs],
            self.device,
            [s.token_ids for s in seqs],
            [s.num_prompt_tokens for s in seqs],
        )
        tokens = sample(logits, tensors, self.sampling_kernels, masks)
        token_ids = tokens.tolist()
        commit_rows(grammars, token_ids)
        logprobs = None
        num_top = max((s.params.logprobs or 0) for s in seqs)
        if any(s.params.logprobs is not None for s in seqs):
            chosen, ids, values = top_logprobs(logits, tokens, num_top)
            logprobs = list(zip(chosen.tolist(), ids.tolist(), values.tolist(), strict=True))
        return StepOutput(
            inputs.sample_rows,
            token_ids,
            logprobs,
            inputs,
            metadata,
            out,
            sampled=tokens,
            kv_step=step,
            prompt_logprobs=prompt,
        )

"""CUDA graphs of the unified speculative step.

Inputs live in persistent device buffers (``PersistentInputBuffers``), allocated once.
Each step shape (K verified, K proposed, greedy or sampled rows, with or without the
structured-output bitmask) is captured once per batch bucket, largest bucket first, into
one shared memory pool. A batch is padded up to the next bucket; padded rows hold no KV,
and every block-table entry of theirs, and every entry past a real row's own width, is a
scratch block that no request owns, so their writes and any read past a row's table land
there and never in a real block (nor at ``block_table[-1]``). Batches the graphs do not
cover (penalties, sampled drafts, a shape not captured, more rows than the largest bucket)
run eagerly, unpadded: ``dispatch`` decides. Outputs are copied to pinned host memory
behind an event, in two alternating slots, so that the host may read a step's tokens
while the next step runs.

On CPU the runner takes the same path (buffers, padding, the same step on bucket-sized
views) without capture, so that padding and bucketing are tested there.

Split over ranks, each rank captures the target's forward of the same step in a graph of
its own (its all-reduces inside), and rank 0 names each graph before replaying its own:
``engine.executor.graph_steps`` (``peers``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import torch

from engine.executor.graph_steps import NO_PEERS, GraphPeers
from engine.sampler import SamplingTensors
from engine.spec.unified_step import SpecStepInputs, SpecStepOutputs, UnifiedStep


def batch_buckets(max_batch_size: int) -> list[int]:
    """Captured batch sizes: 1, 2, 4, 8, then every 8 from 16, and ``max_batch_size``."""
    sizes = {b for b in (1, 2, 4, 8) if b < max_batch_size}
    sizes.update(range(16, max_batch_size, 8))
    sizes.add(max_batch_size)
    return sorted(sizes)


def blocks_per_seq(max_seq_len: int, block_size: int) -> int:
    """Block-table width that addresses ``max_seq_len`` slots (a step's context bound)."""
    return -(-max_seq_len // block_size)


class StepShape(NamedTuple):
    """What one captured graph computes, besides its batch size."""

    k: int  # drafts verified per row
    k_next: int  # drafts proposed per row
    defer_drafter: bool  # a plain step: the drafter idle, features returned
    is_greedy: bool  # every row greedy (else the sampling path with every filter on)
    has_bitmask: bool  # the structured-output bitmask is applied


class GraphKey(NamedTuple):
    bucket: int
    shape: StepShape


@dataclass
class PersistentInputBuffers:
    """Device buffers a captured step reads; each step copies its rows in and pads the rest.

    Padding rows: pending token 0, no KV, every table entry the scratch block, greedy, and
    an all-allowed bitmask.
    """

    tokens: torch.Tensor  # [max_batch_size] int64: each row's pending token x_n
    draft_tokens: torch.Tensor  # [max_batch_size, max_k] int64: the previous step's drafts
    kv_lens: torch.Tensor  # [max_batch_size] int64: committed KV length (position of x_n)
    block_tables: torch.Tensor  # [max_batch_size, max_blocks_per_seq] int64
    temperature: torch.Tensor  # [max_batch_size] fp32, 0 = greedy
    top_k: torch.Tensor  # [max_batch_size] int64, 0 = off
    top_p: torch.Tensor  # [max_batch_size] fp32
    min_p: torch.Tensor  # [max_batch_size] fp32
    seed: torch.Tensor  # [max_batch_size] int64: each row's request seed
    bitmask: torch.Tensor | None  # [max_batch_size, max_k + 1, ceil(V/32)] int32; None: off

    @classmethod
    def alloc(
        cls,
        max_batch_size: int,
        max_batch_input_tokens: int,
        device: torch.device,
        *,
        max_blocks_per_seq: int = 1,
        bitmask_words: int = 0,
    ) -> PersistentInputBuffers:
        """``max_batch_input_tokens``: the verified tokens of a full batch, which is
        ``max_batch_size * (K + 1)``; ``bitmask_words`` > 0 allocates the bitmask slot."""
        if max_batch_size < 1 or max_batch_input_tokens % max_batch_size:
            raise ValueError(
                f"max_batch_input_tokens: {max_batch_input_tokens} is not a multiple of "
                f"max_batch_size {max_batch_size} (it is max_batch_size * (K + 1))"
            )
        b, k = max_batch_size, max_batch_input_tokens // max_batch_size - 1
        if k < 0 or max_blocks_per_seq < 1:
            raise ValueError(f"max_batch_input_tokens: {max_batch_input_tokens} holds no row")

        def zeros(*shape: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        return cls(
            tokens=zeros(b),
            draft_tokens=zeros(b, k),
            kv_lens=zeros(b),
            block_tables=zeros(b, max_blocks_per_seq),
            temperature=zeros(b, dtype=torch.float32),
            top_k=zeros(b),
            top_p=torch.ones(b, dtype=torch.float32, device=device),
            min_p=zeros(b, dtype=torch.float32),
            seed=zeros(b),
            bitmask=zeros(b, k + 1, bitmask_words, dtype=torch.int32) if bitmask_words else None,
        )

    @property
    def max_batch_size(self) -> int:
        return self.tokens.shape[0]

    @property
    def max_k(self) -> int:
        return self.draft_tokens.shape[1]

    def fill(self, inputs: SpecStepInputs | None, bucket: int, scratch_block: int) -> None:
        """``inputs``' rows first (none: all padding), then padding rows up to ``bucket``."""
        b = 0 if inputs is None else inputs.tokens.shape[0]
        self.block_tables[:bucket].fill_(scratch_block)
        for buf, pad in (
            (self.tokens, 0),
            (self.draft_tokens, 0),
            (self.kv_lens, 0),
            (self.temperature, 0.0),
            (self.top_k, 0),
            (self.top_p, 1.0),
            (self.min_p, 0.0),
            (self.seed, 0),
            (self.bitmask, -1),  # every bit set: all allowed
        ):
            if buf is not None:
                buf[b:bucket].fill_(pad)
        if inputs is None:
            return
        k, width = inputs.draft_tokens.shape[1], inputs.block_tables.shape[1]
        s = inputs.sampling
        self.tokens[:b].copy_(inputs.tokens)
        self.draft_tokens[:b, :k].copy_(inputs.draft_tokens)
        self.kv_lens[:b].copy_(inputs.kv_lens)
        self.block_tables[:b, :width].copy_(inputs.block_tables)
        self.temperature[:b].copy_(s.temperature)
        self.top_k[:b].copy_(s.top_k)
        self.top_p[:b].copy_(s.top_p)
        self.min_p[:b].copy_(s.min_p)
        self.seed[:b].copy_(s.seeds)
        if inputs.bitmask is not None:
            assert self.bitmask is not None
            self.bitmask[:b, : k + 1].copy_(inputs.bitmask)

    def step_inputs(self, key: GraphKey, max_context_len: int) -> SpecStepInputs:
        """Views of the first ``key.bucket`` rows, as the step of ``key.shape`` reads them."""
        b, shape = key
        sampled = not shape.is_greedy  # the sampling path with every filter: exact for all
        return SpecStepInputs(
            tokens=self.tokens[:b],
            draft_tokens=self.draft_tokens[:b, : shape.k],
            kv_lens=self.kv_lens[:b],
            block_tables=self.block_tables[:b],
            sampling=SamplingTensors(
                temperature=self.temperature[:b],
                top_k=self.top_k[:b],
                top_p=self.top_p[:b],
                min_p=self.min_p[:b],
                seeds=self.seed[:b],
                positions=self.kv_lens[:b] + 1,  # not read by the step (see SpecStepInputs)
                all_greedy=shape.is_greedy,
                uses_top_k=sampled,
                uses_top_p=sampled,
                uses_min_p=sampled,
            ),
            max_context_len=max_context_len,
            bitmask=self.bitmask[:b, : shape.k + 1]
            if shape.has_bitmask and self.bitmask is not None
            else None,
        )


@dataclass
class PendingStep:
    """A launched step: its outputs on the device (valid until the slot's next use) and its
    small outputs on their way to pinned host memory."""

    outputs: SpecStepOutputs
    num_accepted: torch.Tensor  # [B] host
    emitted: torch.Tensor  # [B, K+1] host
    next_draft_tokens: torch.Tensor  # [B, k_next] host
    event: torch.cuda.Event | None  # recorded after the copies (None on CPU)

    def host(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Waits for the copies: ``num_accepted``, ``emitted``, ``next_draft_tokens``."""
        if self.event is not None:
            self.event.synchronize()
        return self.num_accepted, self.emitted, self.next_draft_tokens


class StepGraphRunner:
    """Runs the unified step through captured graphs where it can, else eagerly."""

    def __init__(
        self,
        step: UnifiedStep,
        buffers: PersistentInputBuffers,
        scratch_block: int,
        *,
        use_graphs: bool | None = None,  # None: on CUDA
        peers: GraphPeers = NO_PEERS,  # the other ranks', split over several
    ) -> None:
        self.step, self.buffers, self.scratch_block = step, buffers, scratch_block
        self.peers = peers
        device = buffers.tokens.device
        self.use_graphs = device.type == "cuda" if use_graphs is None else use_graphs
        self.buckets = batch_buckets(buffers.max_batch_size)
        # Fixed per graph: the context every table row can address.
        self.max_context_len = buffers.block_tables.shape[1] * step.block_size
        self.shapes: set[StepShape] = set()
        self.graphs: dict[GraphKey, tuple[torch.cuda.CUDAGraph, SpecStepOutputs]] = {}
        self.pool: Any = None  # the graphs' shared memory pool (after the first capture)
        self.held: list[Any] = []  # the KV pools (PagedKVCache) the graphs address: pinned
        self._placeable: list[bool] = []
        self.num_graph_steps = 0
        self.num_eager_steps = 0
        pin = device.type == "cuda"
        b, k = buffers.max_batch_size, buffers.max_k

        def host(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.int64, pin_memory=pin)

        # Two slots: step n's tokens stay readable while step n+1 is launched.
        self._host = [(host(b), host(b, k + 1), host(b, k)) for _ in range(2)]
        self._slot = 0

    def capture(self, shapes: list[StepShape]) -> None:
        """Every shape at every bucket, largest bucket first, into one memory pool (on
        CUDA; elsewhere the shapes are only served padded)."""
        for shape in shapes:
            if shape.k > self.buffers.max_k or shape.k_next > self.buffers.max_k:
                raise ValueError(f"capture: {shape} needs more drafts than the buffers hold")
            if shape.has_bitmask and self.buffers.bitmask is None:
                raise ValueError(f"capture: {shape} needs the bitmask slot; alloc it")
        self.shapes.update(shapes)
        if not self.use_graphs:
            return
        for bucket in reversed(self.buckets):
            for shape in shapes:
                self._capture(GraphKey(bucket, shape))

    def hold(self, *pools: Any) -> None:
        """The KV pools (``PagedKVCache``) the captured graphs read and write: pinned while
        graphs exist, since moving them would leave the graphs on freed memory."""
        self.held = [p for p in pools if p is not None]
        self._placeable = [p.is_placeable for p in self.held]  # as they were before
        if self.graphs:
            for p in self.held:
                p.pin()

    def release(self) -> None:
        """Drops the captured graphs and their memory pool, and unpins the pools they held
        (a decode worker moves them into memory it shares), until ``recapture``."""
        self.graphs.clear()
        self.pool = None
        for p, was_placeable in zip(self.held, self._placeable, strict=True):
            p.is_placeable = was_placeable

    def recapture(self) -> None:
        """Captures every shape again, over the pools where they lie now, and pins them."""
        self.capture(sorted(self.shapes))
        self.hold(*self.held)

    @torch.inference_mode()
    def _capture(self, key: GraphKey) -> None:
        # Padding rows only: the warm-up and the capture write the scratch block alone.
        self.buffers.fill(None, key.bucket, self.scratch_block)
        inputs = self.buffers.step_inputs(key, self.max_context_len)
        shape = key.shape
        with self.peers.step(key, capturing=False):  # lazy init, JIT
            self.step(inputs, shape.k_next, defer_drafter=shape.defer_drafter)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with self.peers.step(key, capturing=True), torch.cuda.graph(graph, pool=self.pool):
            out = self.step(inputs, shape.k_next, defer_drafter=shape.defer_drafter)
        if self.pool is None:
            self.pool = graph.pool()
        self.graphs[key] = (graph, out)

    def dispatch(
        self, inputs: SpecStepInputs, k_next: int, defer_drafter: bool = False
    ) -> GraphKey | None:
        """The bucket and shape that run ``inputs``, or None: run eagerly, unpadded."""
        b, k = inputs.draft_tokens.shape
        if inputs.sampling.penalties is not None or inputs.draft_probs is not None:
            return None
        if inputs.block_tables.shape[1] > self.buffers.block_tables.shape[1]:
            return None
        if inputs.max_context_len > self.max_context_len:
            return None
        bucket = next((x for x in self.buckets if x >= b), None)
        shape = StepShape(
            k, k_next, defer_drafter, inputs.sampling.all_greedy, inputs.bitmask is not None
        )
        if bucket is None or shape not in self.shapes:
            return None
        return GraphKey(bucket, shape)

    @torch.inference_mode()
    def __call__(
        self, inputs: SpecStepInputs, k_next: int, *, defer_drafter: bool = False
    ) -> SpecStepOutputs:
        """What ``UnifiedStep`` returns for ``inputs``; through a graph, its tensors are
        views of the graph's outputs, valid until the next call."""
        key = self.dispatch(inputs, k_next, defer_drafter)
        if key is None:
            self.num_eager_steps += 1
            return self.step(inputs, k_next, defer_drafter=defer_drafter)
        self.num_graph_steps += 1
        self.buffers.fill(inputs, key.bucket, self.scratch_block)
        self._guard_tables(inputs, k_next)
        if key in self.graphs:
            graph, out = self.graphs[key]
            self.peers.replay(key)
            graph.replay()
        else:  # the same step on the padded views, eagerly (CPU, or shapes not captured)
            padded = self.buffers.step_inputs(key, self.max_context_len)
            with self.peers.step(key, capturing=False):
                out = self.step(padded, k_next, defer_drafter=defer_drafter)
        return _first_rows(out, inputs.tokens.shape[0])

    def _guard_tables(self, inputs: SpecStepInputs, k_next: int) -> None:
        """Table entries past the last block a row's step can reach become the scratch
        block as well: the engine pads a table with 0, which is some request's real block.
        A step reaches the positions below n + k + max(k_next, DFlash block) + 3."""
        b, k = inputs.draft_tokens.shape
        drafter = self.step.drafter
        fixed = (drafter.fixed_num_draft_tokens if drafter is not None else None) or 0
        reach = k + max(k_next, fixed) + 3
        tables = self.buffers.block_tables[:b]
        last = (inputs.kv_lens + reach - 1) // self.step.block_size  # [B] last column used
        cols = torch.arange(tables.shape[1], device=tables.device)
        tables.masked_fill_(cols[None, :] > last[:, None], self.scratch_block)

    @torch.inference_mode()
    def launch(
        self, inputs: SpecStepInputs, k_next: int, *, defer_drafter: bool = False
    ) -> PendingStep:
        """Runs the step and starts the copies of its tokens to pinned host memory."""
        out = self(inputs, k_next, defer_drafter=defer_drafter)
        b, s = out.emitted.shape
        accepted, emitted, drafts = self._host[self._slot]
        self._slot ^= 1
        host = (accepted[:b], emitted[:b, :s], drafts[:b, :k_next])
        for dst, src in zip(
            host, (out.num_accepted, out.emitted, out.next_draft_tokens), strict=True
        ):
            dst.copy_(src, non_blocking=True)
        event = None
        if out.emitted.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        return PendingStep(out, *host, event=event)


def _first_rows(out: SpecStepOutputs, b: int) -> SpecStepOutputs:
    """The outputs of the real rows of a padded batch."""
    probs, features = out.next_draft_probs, out.features
    return replace(
        out,
        num_accepted=out.num_accepted[:b],
        next_tokens=out.next_tokens[:b],
        emitted=out.emitted[:b],
        next_draft_tokens=out.next_draft_tokens[:b],
        next_draft_probs=None if probs is None else probs[:b],
        logits=out.logits[:b],
        features=None if features is None else features[:b],
    )

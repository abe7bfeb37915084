"""One request's path through the cluster (its P and D, deadline and tokens sent), as the
router's service and its migration share it."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import grpc  # type: ignore[import-untyped]  # no types-grpcio in the dev extra

from ledger.ledger import RequestState, WorkerInfo
from router.validation import ValidRequest
from serving.lora_setup import worker_loras
from serving.metrics import RouterMetrics
from tandem.v1 import generation_pb2 as gen
from tandem.v1 import worker_pb2 as pb

DEADLINE_SLACK_S = 0.05  # errors this close to the deadline are the deadline's doing


@dataclass
class Route:
    """One request's path through the cluster."""

    request: ValidRequest
    prefill: WorkerInfo
    decode: WorkerInfo
    deadline: float  # time.monotonic()
    output_tokens_sent: list[int] = field(default_factory=list)  # streamed to the client
    # This router's epoch in the ledger record while the router owns it, and the one a
    # decode worker hands a preempted request back at; kept when the router registers
    # again after a Redis restart (a record the decode worker rebuilt carries it on).
    owner_epoch: int = 0
    # The speculative counters of attempts that ended in a preemption (their last chunk
    # carries them); added to the final chunk's. An attempt whose decode worker died
    # reports nothing, and is not counted.
    earlier_drafts: gen.SpeculativeUsage | None = None
    # Ids of workers an attempt failed on (``migration.at_fault``: a stalled engine or
    # push, a bad checksum): the request's next attempts go to others where others can.
    avoid: set[str] = field(default_factory=set)

    def count_attempt(self, usage: gen.Usage) -> None:
        if usage.HasField("speculative"):
            if self.earlier_drafts is None:
                self.earlier_drafts = gen.SpeculativeUsage()
            _add(self.earlier_drafts, usage.speculative)

    def with_earlier_attempts(self, chunk: gen.GenerateChunk) -> gen.GenerateChunk:
        """The final chunk, its usage counting the drafts of every earlier attempt too."""
        if self.earlier_drafts is not None and chunk.HasField("usage"):
            _add(chunk.usage.speculative, self.earlier_drafts)
        return chunk

    def first_chunk(self, prefilled: pb.PrefillReply) -> gen.GenerateChunk | None:
        """Chunk 0 from P's reply, sent before D starts: on a first attempt that P
        prefilled, that goes on after its first token, and whose D streams after it (its
        heartbeat says so); else None: D streams it."""
        if prefilled.is_finished or self.output_tokens_sent:
            return None
        if self.decode.stats.get("first_token_from_router", "0") != "1":
            return None  # a decode worker from before this (a rolling update) streams it
        token = prefilled.first_token_id
        chunk = gen.GenerateChunk(
            request_id=self.request.request_id,
            index=0,
            token_ids=[token],
            text=prefilled.first_text,
            prompt_logprobs=prefilled.prompt_logprobs,
        )
        if self.request.sampling.HasField("logprobs"):
            if prefilled.HasField("first_token_logprob"):
                chunk.logprobs.append(prefilled.first_token_logprob)
            else:
                chunk.logprobs.append(gen.TokenLogprob(token_id=token))
        return chunk

    @property
    def workers(self) -> tuple[WorkerInfo, ...]:
        """Its P and D; a co-located worker (both) once."""
        return (self.decode,) if self.is_colocated else (self.prefill, self.decode)

    @property
    def lora_digest(self) -> str:
        """The digest of the request's LoRA adapter on its P (and D: they were paired by
        it); "" for the base model."""
        lora = self.request.lora
        return worker_loras(self.prefill.stats).get(lora, "") if lora else ""

    @property
    def is_colocated(self) -> bool:
        """Its P and D are one co-located worker: one process, the KV handed over in place."""
        return self.prefill.worker_id == self.decode.worker_id

    @property
    def token_ids(self) -> list[int]:
        """What P prefills and D holds: the prompt, then any output already sent (a request
        resumed after a preemption)."""
        return self.request.prompt_token_ids + self.output_tokens_sent

    def prefill_request(self, model: str, reserve: pb.ReserveReply) -> pb.PrefillRequest:
        """What P is asked to prefill, into the blocks D reserved (``reserve``)."""
        return pb.PrefillRequest(
            request_id=self.request.request_id,
            model=model,
            prompt_token_ids=self.token_ids,
            sampling=self.request.sampling,
            decode_address=self.decode.address,
            decode_block_ids=reserve.block_ids,
            num_cached_blocks=reserve.num_cached_blocks,
            decode_epoch=reserve.epoch,
            decode_worker_id=self.decode.worker_id,
            decode_host_id=reserve.host_id,
            decode_kv_pools_bus_id=reserve.kv_pools_bus_id,
            num_output_tokens_sent=len(self.output_tokens_sent),
            lora=self.request.lora,
            lora_digest=self.lora_digest,
        )

    def remaining(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("deadline: exceeded before the request finished")
        return left


def how_it_ended(error: BaseException, route: Route) -> tuple[RequestState, str]:
    """CANCELLED past the deadline or on cancellation, else FAILED, with the reason."""
    if time.monotonic() >= route.deadline - DEADLINE_SLACK_S:
        return RequestState.CANCELLED, "deadline"
    if isinstance(error, asyncio.CancelledError | GeneratorExit):  # the client went away
        return RequestState.CANCELLED, "cancelled"
    if isinstance(error, grpc.aio.AioRpcError):
        return RequestState.FAILED, f"{error.code().name}: {error.details()}"
    return RequestState.FAILED, f"{type(error).__name__}: {error}"


class StreamTiming:
    """One request's latencies, into the router's histograms."""

    def __init__(
        self, metrics: RouterMetrics, arrived: float, model: str, num_prompt_tokens: int
    ) -> None:
        self.metrics = metrics
        self.arrived = arrived
        self.last_sent: float | None = None
        self.model = model  # the served model's name, or the LoRA adapter's the request named
        metrics.model_prompt_tokens.labels(metrics.role, model).inc(num_prompt_tokens)

    def queued(self, computing_since: float) -> None:
        self.metrics.queue_seconds.labels(self.metrics.role).observe(
            max(0.0, computing_since - self.arrived)
        )

    def sent(self, chunk: gen.GenerateChunk) -> None:
        if not chunk.token_ids:
            return
        now, role = time.monotonic(), self.metrics.role
        self.metrics.model_generation_tokens.labels(role, self.model).inc(len(chunk.token_ids))
        if self.last_sent is None:
            self.metrics.ttft_seconds.labels(role).observe(now - self.arrived)
        else:
            self.metrics.inter_token_seconds.labels(role).observe(now - self.last_sent)
        self.last_sent = now

    def ended(self, status: str) -> None:
        role = self.metrics.role
        self.metrics.e2e_seconds.labels(role).observe(time.monotonic() - self.arrived)
        self.metrics.requests.labels(role, status).inc()
        self.metrics.model_requests.labels(role, self.model, status).inc()


def _add(total: gen.SpeculativeUsage, more: gen.SpeculativeUsage) -> None:
    total.num_drafts += more.num_drafts
    total.num_draft_tokens += more.num_draft_tokens
    total.num_accepted_tokens += more.num_accepted_tokens
    total.num_steps_without_drafts += more.num_steps_without_drafts

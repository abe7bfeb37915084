"""The decode worker's servicer: Reserve blocks, receive the KV (KvTransfer on the same
server), Decode as the engine loop produces tokens, Abort, Stats.

A request goes RESERVED (blocks held, KV on its way) -> DECODING (in the running batch,
its stream fed by the engine thread; the blocks its table grows by are recorded in the
ledger after each step, off the engine thread) -> gone. Whatever ends it (finish, abort,
the router cancelling the stream, a failed push) frees its blocks in the engine, the
receiver and the ledger. When the ledger's Redis restarts empty or is restored from a
snapshot, the requests decoding here are recorded again from this worker's memory
(``held_requests``, ledger.membership) and their streams go on.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import redis

from engine.llm_engine import LLMEngine, RequestOutput
from kv_transfer import KvLayout, KvReceiver, KvReservation, TransferState, host_id
from ledger.ledger import LedgerConflict, RequestState
from ledger.membership import HeldRequest, Membership
from serving.engine_loop import BlockTableWatch, EngineLoop, block_tables
from serving.engine_setup import draft_figures
from serving.metrics import DecodeFigures, DecodeMetrics
from serving.rpc import NotFound, PreconditionFailed, Unavailable
from serving.sampling import params_from_proto, token_logprob_to_proto
from tandem.v1 import generation_pb2 as gen
from tandem.v1 import worker_pb2 as pb
from tandem.v1 import worker_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

FINISH_REASONS: dict[str, gen.FinishReason.ValueType] = {
    "stop": gen.FINISH_REASON_STOP,
    "length": gen.FINISH_REASON_LENGTH,
    "abort": gen.FINISH_REASON_ABORT,
}


class _Aborted(Exception):
    """The request was aborted (Abort RPC, lease lost, engine failure) while streaming."""


PREEMPTED = "preempted"  # RequestOutput.finish_reason of a request handed back (hand_back)


class OutputSlot:
    """The newest output of one request. Outputs are cumulative (all tokens so far), so
    keeping only the newest loses nothing and bounds what a slow reader can pile up."""

    def __init__(self) -> None:
        self.output: RequestOutput | None = None
        self.error: BaseException | None = None
        self._event = asyncio.Event()

    def update(self, output: RequestOutput) -> None:
        current = self.output
        if current is None or output.finished or len(output.token_ids) > len(current.token_ids):
            self.output = output
            self._event.set()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self._event.set()

    async def next(self) -> RequestOutput:
        await self._event.wait()
        self._event.clear()
        if self.error is not None:
            raise self.error
        assert self.output is not None
        return self.output


@dataclass(frozen=True)
class _Step:
    """What one engine step hands the event loop."""

    outputs: list[RequestOutput]
    tables: dict[str, list[int]]  # request id -> its block table, where the step changed it


@dataclass
class _Request:
    request_id: str
    block_ids: list[int]  # its block table: as reserved, then as the engine grew it
    num_prompt_tokens: int  # the client's prompt (without output resumed from a preemption)
    logprobs: int | None
    num_resumed: int  # output tokens an earlier attempt already streamed (a preemption)
    router_id: str  # who gets the request back on a preemption
    router_epoch: int
    num_text_resumed: int = 0  # characters of the resumed output already streamed
    reserved_at: float = field(default_factory=time.monotonic)
    slot: OutputSlot | None = None  # set once Decode started


class DecodeWorkerService(pb_grpc.DecodeWorkerServicer):
    """tandem.v1.DecodeWorker over one engine (owned by ``engine_loop``'s thread)."""

    def __init__(
        self,
        engine: LLMEngine,
        *,
        served_name: str,
        layout: KvLayout,
        draft: pb.DraftConfig | None,
        receiver: KvReceiver,
        membership: Membership,
        reserve_timeout_s: float,
        decode_timeout_s: float = 600.0,
        accepts_shm: bool = True,
        metrics: DecodeMetrics | None = None,
    ) -> None:
        self.engine = engine
        self.served_name = served_name
        self.layout = layout
        self.draft = draft
        self.fingerprint = draft.fingerprint if draft is not None else ""
        self.receiver = receiver
        self.membership = membership
        self.reserve_timeout_s = reserve_timeout_s
        self.decode_timeout_s = decode_timeout_s
        self.host_id = host_id() if accepts_shm else ""  # "": senders use gRPC
        self.block_size = engine.config.block_size
        self._pools = engine.kv_pools
        self._requests: dict[str, _Request] = {}
        self.is_draining = False
        watch = BlockTableWatch()
        self.engine_loop: EngineLoop[_Step] = EngineLoop(
            engine,
            asyncio.get_running_loop(),
            on_step=lambda engine, outputs: _Step(outputs, watch.changed(engine)),
            deliver=self._deliver,
            on_error=self._on_engine_error,
            name="decode-engine",
        )
        self.metrics = metrics or DecodeMetrics()
        self.metrics.read_figures_from(self._figures)

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    # ---- RPCs

    async def Reserve(self, request: pb.ReserveRequest, context: Any) -> pb.ReserveReply:
        rid = request.request_id
        if self.is_draining:
            raise Unavailable("decode worker: draining")
        if request.model and request.model != self.served_name:
            raise PreconditionFailed(f"model: this worker serves {self.served_name!r}")
        if request.draft_fingerprint != self.fingerprint:
            raise PreconditionFailed(
                f"draft_fingerprint: {request.draft_fingerprint!r}, this worker runs "
                f"{self.fingerprint!r}"
            )
        if rid in self._requests:
            raise ValueError(f"request_id: {rid!r} is already reserved here")
        prompt = list(request.prompt_token_ids)
        if len(prompt) != request.num_prompt_tokens:
            raise ValueError(
                f"num_prompt_tokens: {request.num_prompt_tokens}, but {len(prompt)} prompt ids"
            )
        params = params_from_proto(request.sampling)
        num_resumed = request.num_output_tokens_sent
        req = self._requests[rid] = _Request(
            rid,
            [],
            len(prompt) - num_resumed,
            params.logprobs,
            num_resumed,
            request.router_id,
            request.router_epoch,
        )

        def reserve() -> tuple[list[int], int, int]:
            """Engine thread: the blocks, and the characters of resumed output already sent."""
            table, num_cached = self.engine.reserve(rid, prompt, params, num_resumed)
            return table, num_cached, len(self.engine.output_text(rid)) if num_resumed else 0

        try:  # cancelled after the engine reserved: _forget's abort follows it in the queue
            table, num_cached, req.num_text_resumed = await self.engine_loop.call(reserve)
            req.block_ids = table
            num_cached_blocks = num_cached // self.block_size
            reservation = KvReservation(rid, table[num_cached_blocks:], self._pools, self.layout)
            self.receiver.reserve(reservation)
            self.membership.claim(rid, table, has_draft=self.layout.draft is not None)
        except BaseException:
            self._forget(rid)
            raise
        return pb.ReserveReply(
            block_ids=table,
            num_cached_blocks=num_cached_blocks,
            lease_ms=int(self.reserve_timeout_s * 1000),
            epoch=self.membership.epoch,
            block_size=self.block_size,
            host_id=self.host_id,
        )

    async def Decode(
        self, request: pb.DecodeRequest, context: Any
    ) -> AsyncIterator[gen.GenerateChunk]:
        rid = request.request_id
        req = self._requests.get(rid)
        if req is None:
            raise NotFound(f"request_id: {rid!r} is not reserved here (aborted or expired?)")
        if request.epoch != self.membership.epoch:
            raise PreconditionFailed(
                f"epoch: {request.epoch}, this worker is at epoch {self.membership.epoch}"
            )
        if req.slot is not None:
            raise ValueError(f"request_id: {rid!r} is already decoding")
        slot = req.slot = OutputSlot()
        is_finished = False
        status = "aborted"
        try:
            stream = _ChunkStream(req, request)
            if not request.is_finished_on_prefill:
                remaining = context.time_remaining()
                timeout = self.decode_timeout_s if remaining is None else remaining
                await self.receiver.wait_done(rid, timeout)
            self.receiver.release(rid)
            first = await self.engine_loop.call(
                self.engine.start_decoding, rid, request.first_token_id, list(request.draft_tokens)
            )
            if request.is_finished_on_prefill and not first.finished:
                raise RuntimeError("is_finished_on_prefill: the first token did not end it here")
            slot.update(first)
            while True:
                output = await slot.next()
                if output.finish_reason == PREEMPTED:
                    status = PREEMPTED
                    chunk = stream.chunk(dataclasses.replace(output, finished=False))
                    if chunk.token_ids or chunk.text:
                        yield chunk
                    self._hand_back(req)  # before the router hears of it and re-queues it
                    yield stream.preempted()
                    return
                chunk = stream.chunk(output)
                if output.finished:
                    is_finished = True
                    status = "finished"
                    self._end(rid, RequestState.FINISHED)
                    yield chunk
                    return
                if chunk.token_ids or chunk.text:
                    yield chunk
        except _Aborted:
            yield stream.aborted()
        finally:
            self.metrics.requests.labels(self.metrics.role, status).inc()
            if not is_finished:
                self._forget(rid)

    async def Abort(self, request: pb.AbortRequest, context: Any) -> pb.AbortReply:
        req = self._requests.get(request.request_id)
        if req is None:
            return pb.AbortReply(was_known=False)
        log.info("abort %s: %s", request.request_id, request.reason or "no reason given")
        if req.slot is not None:  # the stream ends with an ABORT chunk
            req.slot.fail(_Aborted(request.reason))
        self._forget(request.request_id)
        return pb.AbortReply(was_known=True, num_blocks_freed=len(req.block_ids))

    async def Stats(self, request: pb.StatsRequest, context: Any) -> pb.StatsReply:
        stats = self.engine_loop.stats
        num_reserved = sum(1 for r in self._requests.values() if r.slot is None)
        reply = pb.StatsReply(
            role=pb.WORKER_ROLE_DECODE,
            worker_id=self.membership.worker_id,
            epoch=self.membership.epoch,
            model=self.served_name,
            num_kv_blocks_used=stats.num_used_blocks,
            num_kv_blocks_free=stats.num_free_blocks,
            num_running=stats.num_running,
            num_waiting=num_reserved,
            load=stats.load,
            block_size=self.block_size,
        )
        if self.draft is not None:
            reply.draft.CopyFrom(self.draft)
        if stats.num_drafts is not None:
            reply.speculative.CopyFrom(
                gen.SpeculativeUsage(
                    num_drafts=stats.num_drafts,
                    num_draft_tokens=stats.num_draft_tokens,
                    num_accepted_tokens=stats.num_accepted_tokens,
                )
            )
        if request.include_block_ids:
            await self.engine_loop.report_block_ids(reply)
        return reply

    # ---- lifecycle

    def load(self) -> tuple[float, dict[str, str | int | float]]:
        """Load and figures for heartbeats."""
        stats = self.engine_loop.stats
        figures: dict[str, str | int | float] = {
            "model": self.served_name,
            "num_running": stats.num_running,
            "num_free_blocks": stats.num_free_blocks,
            "num_requests": len(self._requests),
            "draining": int(self.is_draining),
            **draft_figures(self.draft),
        }
        return stats.load, figures

    async def held_requests(self) -> list[HeldRequest]:
        """What the ledger should record again after it lost data (restarted empty, or
        restored from a snapshot): each request whose Decode stream runs here (its record
        was DECODING and this worker's), with the blocks its allocator holds for it now and
        the fields the router recorded. Reservations whose Decode has not begun are left
        out and dropped: their records were at the prefill worker's stage, not this
        worker's to vouch for."""
        decoding = [rid for rid, req in self._requests.items() if req.slot is not None]
        tables = await self.engine_loop.call(block_tables, self.engine, decoding, bounded=False)
        held = []
        for rid in decoding:
            req = self._requests.get(rid)
            if req is None or req.slot is None:
                continue  # ended while the engine was asked
            held.append(
                HeldRequest(
                    rid,
                    # Not in the batch yet (KV just arrived): its reserved blocks.
                    tables.get(rid, req.block_ids),
                    {
                        "model": self.served_name,
                        "num_prompt_tokens": req.num_prompt_tokens,
                        "decode_worker": self.membership.worker_id,
                        "router": req.router_id,
                        "router_epoch": req.router_epoch,
                    },
                )
            )
        return held

    def on_lease_lost(self, request_id: str) -> None:
        """The ledger no longer has this worker holding the request (a stall outlived the
        lease, or the ledger lost data and the record could not be made again): the
        request is dropped here, and its stream ends UNAVAILABLE, which the router answers
        by resuming it elsewhere."""
        req = self._requests.get(request_id)
        if req is not None and req.slot is not None:
            req.slot.fail(
                Unavailable(
                    f"decode worker {self.membership.worker_id}: lost its lease on the "
                    "request's KV blocks in the ledger (a stall, or Redis restarted)"
                )
            )
        self._forget(request_id)

    async def expire_reservations(self) -> None:
        """Frees reservations whose Decode never came (the router went away). One whose KV
        push is open is not idle: the prefill worker holds the stream from the moment the
        request reaches it (queued, computing, sending) and ends it if it gives up."""
        while True:
            await asyncio.sleep(min(1.0, self.reserve_timeout_s / 4))
            now = time.monotonic()
            for req in list(self._requests.values()):
                if self.receiver.state(req.request_id) is TransferState.TRANSFERRING:
                    req.reserved_at = now  # the lapse counts from the push's end
                elif req.slot is None and now - req.reserved_at > self.reserve_timeout_s:
                    log.warning("reservation of %s lapsed", req.request_id)
                    self._forget(req.request_id)

    async def drain(self, timeout_s: float) -> None:
        """Refuses new reservations, waits for running requests to finish."""
        self.is_draining = True
        deadline = time.monotonic() + timeout_s
        while self._requests and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    # ---- internals

    def _figures(self) -> DecodeFigures:
        """For /metrics scrapes (another thread): one snapshot of the engine loop's stats."""
        stats = self.engine_loop.stats
        return DecodeFigures(
            num_kv_blocks_used=stats.num_used_blocks,
            num_kv_blocks_free=stats.num_free_blocks,
            num_running=stats.num_running,
            num_drafts=stats.num_drafts or 0,
            num_draft_tokens=stats.num_draft_tokens,
            num_accepted_tokens=stats.num_accepted_tokens,
        )

    def _deliver(self, step: _Step) -> None:
        for output in step.outputs:
            req = self._requests.get(output.request_id)
            if req is not None and req.slot is not None:
                req.slot.update(output)
        for rid, table in step.tables.items():  # the ledger follows, after this step
            req = self._requests.get(rid)
            if req is not None:
                req.block_ids = table
                self.membership.resize(rid, table)

    def _on_engine_error(self, error: BaseException) -> None:
        for req in list(self._requests.values()):
            if req.slot is not None:
                req.slot.fail(RuntimeError(f"engine step failed: {error}"))
            self._forget(req.request_id)

    def _forget(self, request_id: str) -> None:
        """Frees a request everywhere; idempotent."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return
        self.engine_loop.submit(self.engine.abort_request, request_id, bounded=False)
        self.receiver.release(request_id)
        self.membership.release(request_id)

    def _hand_back(self, req: _Request) -> None:
        """A preempted request (its blocks already freed by the engine) goes back to the
        router that sent it: DECODING -> QUEUED, owned by the router again."""
        self._forget(req.request_id)
        log.info("preempted %s: handed back to %s", req.request_id, req.router_id)
        if not req.router_id:
            return
        with contextlib.suppress(LedgerConflict):  # cancelled meanwhile: the router decided
            self.membership.ledger.transition(
                req.request_id,
                RequestState.QUEUED,
                expected=RequestState.DECODING,
                epoch=self.membership.epoch,
                new_owner=req.router_id,
                new_epoch=req.router_epoch,
            )

    def _end(self, request_id: str, state: RequestState) -> None:
        """A finished request: blocks already freed by the engine; ledger updated. The
        client gets its last chunk even when Redis cannot be reached (the record, if it
        survives, expires)."""
        self._requests.pop(request_id, None)
        self.receiver.release(request_id)
        self.membership.release(request_id)
        try:
            self.membership.ledger.transition(
                request_id, state, expected=RequestState.DECODING, epoch=self.membership.epoch
            )
        except LedgerConflict:  # cancelled meanwhile: the router decided
            pass
        except redis.RedisError as e:
            log.warning("%s %s, not recorded in the ledger: redis: %s", request_id, state, e)


class _ChunkStream:
    """Turns one request's cumulative outputs into consecutive chunks."""

    def __init__(self, req: _Request, request: pb.DecodeRequest) -> None:
        self.req = req
        # Chunks continue where an earlier attempt's stream stopped, text included.
        self.num_sent = req.num_resumed  # tokens already in chunks (by any attempt)
        self.num_text_sent = req.num_text_resumed  # characters already in chunks
        self.first_logprob = (
            request.first_token_logprob if request.HasField("first_token_logprob") else None
        )

    def chunk(self, output: RequestOutput) -> gen.GenerateChunk:
        tokens = output.token_ids[self.num_sent :]
        chunk = gen.GenerateChunk(
            request_id=self.req.request_id,
            index=self.num_sent,
            token_ids=tokens,
            text=output.text[self.num_text_sent :],
        )
        if self.req.logprobs is not None:
            chunk.logprobs.extend(self._logprobs(output, self.num_sent, len(tokens)))
        self.num_sent += len(tokens)
        self.num_text_sent = len(output.text)
        if output.finished:
            reason = FINISH_REASONS.get(output.finish_reason or "", gen.FINISH_REASON_ABORT)
            chunk.finish_reason = reason
            if isinstance(output.stop_reason, int):
                chunk.stop_token_id = output.stop_reason
            elif isinstance(output.stop_reason, str):
                chunk.stop_string = output.stop_reason
            chunk.usage.CopyFrom(
                gen.Usage(
                    prompt_tokens=self.req.num_prompt_tokens,
                    completion_tokens=len(output.token_ids),
                )
            )
        return chunk

    def preempted(self) -> gen.GenerateChunk:
        """The last chunk of a request handed back: the router resumes it elsewhere."""
        return gen.GenerateChunk(
            request_id=self.req.request_id,
            index=self.num_sent,
            finish_reason=gen.FINISH_REASON_PREEMPTED,
        )

    def aborted(self) -> gen.GenerateChunk:
        """The last chunk of a request aborted here."""
        return gen.GenerateChunk(
            request_id=self.req.request_id,
            index=self.num_sent,
            finish_reason=gen.FINISH_REASON_ABORT,
            usage=gen.Usage(
                prompt_tokens=self.req.num_prompt_tokens, completion_tokens=self.num_sent
            ),
        )

    def _logprobs(self, output: RequestOutput, start: int, count: int) -> list[gen.TokenLogprob]:
        """Index r (the tokens resumed before it) was sampled by the prefill worker; index
        i > r is output.logprobs[i - r - 1]."""
        entries = []
        first = self.req.num_resumed
        for i in range(start, start + count):
            token = output.token_ids[i]
            if i == first:
                entries.append(self.first_logprob or gen.TokenLogprob(token_id=token))
            elif 0 <= i - first - 1 < len(output.logprobs):
                entries.append(token_logprob_to_proto(output.logprobs[i - first - 1]))
            else:
                entries.append(gen.TokenLogprob(token_id=token))
        return entries

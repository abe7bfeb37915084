"""The decode worker's servicer: Reserve blocks, receive the KV (KvTransfer on the same
server), Decode as the engine loop produces tokens, Abort, Stats.

A request goes RESERVED (blocks held, KV on its way) -> DECODING (in the running batch,
its stream fed by the engine thread; the blocks its table grows by are recorded in the
ledger after each step, off the engine thread) -> gone. Each request has one handle
(decode_worker.request); whatever ends it (finish, preemption, abort, the router
cancelling the stream, a lost lease, a failed push) calls its ``close``. When the
ledger's Redis restarts empty or is restored from a snapshot, the requests decoding here
are recorded again from this worker's memory (``held_requests``, ledger.membership) and
their streams go on.

Co-located (``colocated_worker``): this service is the decode side of a worker whose
prefill side (``prefill_worker.in_place``) shares its engine. A request goes the same way;
its KV is computed into the blocks reserved here, and the in-process hand-over
(``kv_transfer.in_place``) tells the receiver so.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from decode_worker.chunk_stream import ChunkStream
from decode_worker.request import Aborted, CloseReason, DeltaSlot, Holders, RequestHandle
from decode_worker.transitions import DecodeTransitions
from engine.admission import RequestError
from engine.dp_blocks import rank_of
from engine.engine_figures import BlockTableWatch
from engine.llm_engine import LLMEngine
from engine.output_processor import OutputBuilder
from engine.outputs import (
    NON_FINITE_LOGITS,
    RequestDelta,
    RequestFailed,
    RequestOutput,
    RequestStart,
)
from engine.sequence import FinishReason
from kv_transfer import (
    KV_WIRE_VERSION,
    KvLayout,
    KvReceiver,
    TransferState,
    add_kv_transfer_servicer,
    host_id,
)
from ledger.membership import HeldRequest, Membership
from serving.engine_commands import ReadBlockTables, Reserve, StartDecoding
from serving.engine_loop import EngineLoop, TorchThread
from serving.engine_setup import draft_figures, rank_figures
from serving.lora_calls import LoraCalls
from serving.lora_setup import lora_figure, request_lora
from serving.metrics import DecodeFigures, DecodeMetrics
from serving.rpc import NotFound, PreconditionFailed, Unavailable
from serving.sampling import params_from_proto
from tandem.v1 import generation_pb2 as gen
from tandem.v1 import worker_pb2 as pb
from tandem.v1 import worker_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

EXPIRY_PERIOD_S = 0.25  # how often reservations are looked at
FAILED_PUSH_GRACE_S = 0.5  # a reservation whose push failed: freed after this


@dataclass(frozen=True)
class _Step:
    """What one engine step hands the event loop."""

    deltas: list[RequestDelta]
    tables: dict[str, list[int]]  # request id -> its block table, where the step changed it


class DecodeWorkerService(LoraCalls, pb_grpc.DecodeWorkerServicer):
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
        is_colocated: bool = False,
        torch_thread: TorchThread | None = None,
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
        self.is_colocated = is_colocated  # the decode side of a co-located worker
        self.host_id = host_id() if accepts_shm else ""  # "": senders use gRPC
        shared = receiver.shared_pools if accepts_shm else None
        ipc = shared.ipc if shared is not None else None
        self.kv_pools_bus_id = ipc.bus_id.decode() if ipc is not None else ""  # CUDA IPC
        self.block_size = engine.config.block_size
        self._pools = engine.kv_pools
        self.is_draining = False
        watch = BlockTableWatch()
        self.engine_loop: EngineLoop[_Step] = EngineLoop(
            engine,
            asyncio.get_running_loop(),
            on_step=lambda engine, deltas: _Step(deltas, watch.changed(engine)),
            deliver=self._deliver,
            on_error=self._on_engine_error,
            name="decode-engine",
            thread=torch_thread,  # the thread that built the engine
        )
        self.holders = Holders(
            engine,
            self.engine_loop,
            receiver,
            layout,
            membership,
            DecodeTransitions(membership),
        )
        self._requests = self.holders.handles  # request id -> its handle, until closed
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
        self.holders.check_new(rid)
        prompt = list(request.prompt_token_ids)
        if len(prompt) != request.num_prompt_tokens:
            raise ValueError(
                f"num_prompt_tokens: {request.num_prompt_tokens}, but {len(prompt)} prompt ids"
            )
        params = params_from_proto(request.sampling)
        lora, digest = request_lora(request.lora, request.lora_digest)  # the engine checks it
        num_output_tokens_sent = request.num_output_tokens_sent
        num_prompt_tokens = len(prompt) - num_output_tokens_sent
        start = RequestStart(prompt[:num_prompt_tokens], params, prompt[num_prompt_tokens:])
        handle = RequestHandle(
            self.holders,
            rid,
            OutputBuilder(rid, start, self.engine.tokenizer),
            num_prompt_tokens,
            params.logprobs,
            num_output_tokens_sent,
            request.router_id,
            request.router_epoch,
            lora=request.lora,
            lora_digest=request.lora_digest,
        )
        reserve = Reserve(rid, prompt, params, num_output_tokens_sent, lora, digest)
        try:  # cancelled after the engine reserved: close's drop follows it in the queue
            table, num_cached = await self.engine_loop.call(reserve)
            handle.num_output_chars_sent = len(handle.outputs.text)  # of the resumed output
            num_cached_blocks = num_cached // self.block_size
            num_kv_blocks = -(-len(prompt) // self.block_size)  # what a push fills
            handle.hold(table, num_cached_blocks, num_kv_blocks, self._pools)
        except BaseException as e:
            is_cancelled = isinstance(e, asyncio.CancelledError)
            handle.close(CloseReason.CANCELLED if is_cancelled else CloseReason.FAILED, str(e))
            raise
        return pb.ReserveReply(
            block_ids=table,
            num_cached_blocks=num_cached_blocks,
            lease_ms=int(self.reserve_timeout_s * 1000),
            epoch=self.membership.epoch,
            block_size=self.block_size,
            host_id=self.host_id,
            kv_pools_bus_id=self.kv_pools_bus_id,
            data_parallel_rank=rank_of(self.engine.block_manager, table[0]) if table else 0,
        )

    async def Decode(
        self, request: pb.DecodeRequest, context: Any
    ) -> AsyncIterator[gen.GenerateChunk]:
        rid = request.request_id
        handle = self._requests.get(rid)
        if handle is None:
            raise NotFound(f"request_id: {rid!r} is not reserved here (aborted or expired?)")
        if request.epoch != self.membership.epoch:
            raise PreconditionFailed(
                f"epoch: {request.epoch}, this worker is at epoch {self.membership.epoch}"
            )
        if handle.slot is not None:
            raise ValueError(f"request_id: {rid!r} is already decoding")
        if request.is_first_token_sent and (
            request.is_finished_on_prefill or handle.num_output_tokens_sent
        ):
            raise ValueError(
                "is_first_token_sent: only on a first attempt that goes on after its first "
                "token (not with is_finished_on_prefill or a resumed request)"
            )
        handle.slot = DeltaSlot()
        try:
            stream = ChunkStream(handle, request)
            first = await self._start_decoding(handle, request, context)
            if request.is_first_token_sent:
                stream.sent_by_router(first, request.first_text)
            output: RequestOutput | None = first
            while True:
                if output is None:
                    output = await handle.next_output()
                if output.finish_reason is FinishReason.PREEMPTED:
                    chunk = stream.chunk(dataclasses.replace(output, finished=False))
                    if chunk.token_ids or chunk.text:
                        yield chunk
                    handle.close(CloseReason.PREEMPTED)  # before the router re-queues it
                    yield stream.preempted()
                    return
                if output.finish_reason is FinishReason.ERROR:
                    raise RequestFailed(NON_FINITE_LOGITS)
                chunk = stream.chunk(output)
                if output.finished:
                    handle.close(CloseReason.FINISHED)
                    yield chunk
                    return
                if chunk.token_ids or chunk.text:
                    yield chunk
                output = None
        except Aborted:
            yield stream.aborted()
        except Exception as e:
            handle.close(CloseReason.FAILED, str(e))
            raise
        finally:
            handle.close(CloseReason.CANCELLED)  # the router ended the stream
            reason = handle.closed_by or CloseReason.CANCELLED
            self.metrics.requests.labels(self.metrics.role, reason.metric_status).inc()

    async def _start_decoding(
        self, handle: RequestHandle, request: pb.DecodeRequest, context: Any
    ) -> RequestOutput:
        """Waits for the pushed KV, then joins the request to the batch with the first
        token (and drafts) the prefill worker sampled; the output that token makes. A
        request that the first token ended on the prefill worker must end with it here."""
        timeout = None
        if not request.is_finished_on_prefill:
            remaining = context.time_remaining()
            timeout = self.decode_timeout_s if remaining is None else remaining
        await handle.wait_for_kv(timeout)
        # Finished on prefill: no KV was pushed (or only part), so none is cached here.
        start = StartDecoding(
            request.request_id,
            request.first_token_id,
            list(request.draft_tokens),
            has_kv=not request.is_finished_on_prefill,
        )
        handle.outputs.take(await self.engine_loop.call(start))  # its first: always taken
        output = handle.outputs.output()
        if request.is_finished_on_prefill and not output.finished:
            raise RequestError(
                f"first_token: {request.first_token_id} ended request {request.request_id!r} "
                "on the prefill worker (no KV sent), but does not end it here"
            )
        return output

    async def Abort(self, request: pb.AbortRequest, context: Any) -> pb.AbortReply:
        handle = self._requests.get(request.request_id)
        if handle is None:
            return pb.AbortReply(was_known=False)
        log.info("abort %s: %s", request.request_id, request.reason or "no reason given")
        handle.close(CloseReason.ABORTED, request.reason)  # a running stream ends with ABORT
        return pb.AbortReply(was_known=True, num_blocks_freed=len(handle.block_ids))

    async def Stats(self, request: pb.StatsRequest, context: Any) -> pb.StatsReply:
        stats = self.engine_loop.stats
        num_reserved = sum(1 for h in self._requests.values() if h.slot is None)
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
                    num_steps_without_drafts=stats.num_steps_without_drafts,
                )
            )
        if request.include_block_ids:
            await self.engine_loop.report_block_ids(reply)
        return reply

    # ---- lifecycle (serving.component.Service)

    def add_to(self, server: Any) -> None:
        pb_grpc.add_DecodeWorkerServicer_to_server(self, server)
        add_kv_transfer_servicer(server, self.receiver)

    def start(self) -> None:
        self.engine_loop.start()

    async def housekeeping(self) -> None:
        await self.expire_reservations()

    async def close(self) -> None:
        self.engine_loop.stop()

    def load(self) -> tuple[float, dict[str, str | int | float]]:
        """Load and figures for heartbeats."""
        stats = self.engine_loop.stats
        figures: dict[str, str | int | float] = {
            "model": self.served_name,
            "num_running": stats.num_running,
            "num_free_blocks": stats.num_free_blocks,
            "num_requests": len(self._requests),
            "draining": int(self.is_draining),
            # Its process prefills in place for it (colocated_worker): routers pair it with
            # itself. A name no other version publishes, so that versions do not mix.
            "prefills_in_place": int(self.is_colocated),
            # Streams after a first token the router sent (DecodeRequest.is_first_token_sent).
            "first_token_from_router": 1,
            "kv_wire_version": KV_WIRE_VERSION,  # routers pair workers of one version
            **rank_figures(self.engine, stats),
            **draft_figures(self.draft),
            **lora_figure(self.loras),
        }
        return stats.load, figures

    async def held_requests(self) -> list[HeldRequest]:
        """What the ledger should record again after it lost data (restarted empty, or
        restored from a snapshot): each request whose Decode stream runs here (its record
        was DECODING and this worker's), with the blocks its allocator holds for it now and
        the fields the router recorded. Reservations whose Decode has not begun are left
        out and dropped: their records were at the prefill worker's stage, not this
        worker's to vouch for."""
        decoding = [rid for rid, handle in self._requests.items() if handle.slot is not None]
        tables = await self.engine_loop.call(ReadBlockTables(decoding))
        held = []
        for rid in decoding:
            handle = self._requests.get(rid)
            if handle is None or handle.slot is None:
                continue  # ended while the engine was asked
            fields: dict[str, str | int] = {
                "model": self.served_name,
                "num_prompt_tokens": handle.num_prompt_tokens,
                "decode_worker": self.membership.worker_id,
                "router": handle.router_id,
                "router_epoch": handle.router_epoch,
            }
            held.append(handle.held(tables.get(rid), fields))  # None: not in the batch yet
        return held

    def on_lease_lost(self, request_id: str) -> None:
        """The ledger no longer has this worker holding the request (a stall outlived the
        lease, or the ledger lost data and the record could not be made again): the
        request is dropped here, and its stream ends UNAVAILABLE, which the router answers
        by resuming it elsewhere."""
        handle = self._requests.get(request_id)
        if handle is not None:
            handle.close(CloseReason.LEASE_LOST)

    def on_registered(self, epoch: int) -> None:
        """Registered (at start, or again after Redis lost data or a stall): KV pushes
        into reservations must carry this epoch from now on."""
        self.receiver.epoch = epoch

    async def expire_reservations(self) -> None:
        """Frees reservations whose Decode never came (the router went away), and, within
        a second, those whose KV push was refused or abandoned: such a reservation can
        take no other push. One whose KV push is open is not idle: the prefill worker
        holds the stream from the moment the request reaches it (queued, computing,
        sending) and ends it if it gives up."""
        while True:
            await asyncio.sleep(min(EXPIRY_PERIOD_S, self.reserve_timeout_s / 4))
            now = time.monotonic()
            for handle in list(self._requests.values()):
                if handle.slot is not None:
                    continue  # decoding: its Decode call owns it
                state = self.receiver.state(handle.request_id)
                if state is TransferState.TRANSFERRING:
                    handle.reserved_at = now  # the lapse counts from the push's end
                elif state is TransferState.FAILED:
                    if handle.push_failed_at is None:
                        handle.push_failed_at = now  # a Decode call waiting hears it first
                    elif now - handle.push_failed_at >= FAILED_PUSH_GRACE_S:
                        reason = self.receiver.failure(handle.request_id)
                        log.info(
                            "reservation of %s freed: its push failed (%s)",
                            handle.request_id,
                            reason,
                        )
                        handle.close(CloseReason.LAPSED)
                elif now - handle.reserved_at > self.reserve_timeout_s:
                    log.warning("reservation of %s lapsed", handle.request_id)
                    handle.close(CloseReason.LAPSED)

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
            steps_per_k=stats.steps_per_k,
            max_k=stats.max_k,  # suffix decoding has no DraftConfig, but a K
        )

    def _deliver(self, step: _Step) -> None:
        for delta in step.deltas:
            handle = self._requests.get(delta.request_id)
            # A request's first delta comes from StartDecoding alone: one with a start
            # here is a co-located prefill side's, whose outputs are its own.
            if handle is not None and handle.slot is not None and delta.start is None:
                handle.slot.put(delta)
        for rid, table in step.tables.items():  # the ledger follows, after this step
            handle = self._requests.get(rid)
            if handle is not None:
                handle.resize(table)

    def _on_engine_error(self, error: BaseException) -> None:
        for handle in list(self._requests.values()):
            handle.close(CloseReason.FAILED, f"engine step failed: {error}")

"""The prefill worker's servicer: Prefill (engine prefill-only, its KV pushed into the
decode worker's reserved blocks as it is computed), Abort, Stats.

One Prefill: push opened (handshake) and the request queued in the engine thread -> each
step's target layers pushed in groups as the forward writes them (a short prompt's at the
end of its step), its draft layers at the end of the step (kv_push.py) -> first token (and
drafts) sampled, blocks kept (PREFILLED) -> the last layers sent and acknowledged ->
blocks freed -> reply.
Ledger: PREFILLING -> TRANSFERRING (this worker) -> DECODING (handed to the decode worker).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from dataclasses import dataclass
from typing import Any, TypeVar

import redis

from engine.llm_engine import LLMEngine, PrefilledRequest
from engine.output_processor import OutputBuilder
from engine.outputs import (
    NON_FINITE_LOGITS,
    RequestDelta,
    RequestFailed,
    RequestOutput,
    RequestStart,
)
from engine.sequence import FinishReason
from kv_transfer import Handshake, KvLayout, ShmRingPool, TransferOptions, make_sender
from ledger.ledger import WorkerRole
from ledger.membership import HeldRequest, Membership
from prefill_worker.kv_push import LayerPush, LayerRelay
from prefill_worker.transitions import PrefillTransitions
from serving.engine_commands import AddRequest, DropRequest
from serving.engine_loop import EngineLoop, TorchThread
from serving.engine_setup import draft_figures
from serving.metrics import PrefillMetrics
from serving.rpc import ChannelPool, Overloaded, PreconditionFailed, Unavailable
from serving.sampling import params_from_proto, token_logprob_to_proto
from tandem.v1 import worker_pb2 as pb
from tandem.v1 import worker_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

CONNECT_PERIOD_S = 2.0  # how often new decode workers are connected to ahead of use
T = TypeVar("T")


@dataclass
class _Prefilled:
    delta: RequestDelta  # the first token (finished: the engine ended the request with it)
    prefilled: PrefilledRequest | None  # None when finished: no KV to hand on


def _collect(engine: LLMEngine, deltas: list[RequestDelta]) -> list[_Prefilled]:
    """Engine thread: each delta of a prefill-only request is its first token."""
    done = []
    for delta in deltas:
        if delta.finished:
            done.append(_Prefilled(delta, None))
        elif (prefilled := engine.take_prefilled(delta.request_id)) is not None:
            done.append(_Prefilled(delta, prefilled))
    return done


async def _unless_push_failed(future: asyncio.Future[T], push: LayerPush) -> T:
    """The engine's answer; a push that fails meanwhile (its engine clock ran out: the
    engine may not even take the request) fails the request at once."""
    waits: set[asyncio.Future[Any]] = {future, push.task}
    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    if push.task.done() and not future.done():
        push.task.result()  # raises the push's error (a push may also end first: all sent)
    return await future


class PrefillWorkerService(pb_grpc.PrefillWorkerServicer):
    """tandem.v1.PrefillWorker over one engine (owned by ``engine_loop``'s thread)."""

    def __init__(
        self,
        engine: LLMEngine,
        *,
        served_name: str,
        layout: KvLayout,
        draft: pb.DraftConfig | None,
        membership: Membership,
        max_queued: int = 256,
        max_concurrent_pushes: int = 4,
        transfer_options: TransferOptions | None = None,
        use_shm: bool = True,
        metrics: PrefillMetrics | None = None,
        channels: ChannelPool | None = None,
        torch_thread: TorchThread | None = None,
    ) -> None:
        self.engine = engine
        self.served_name = served_name
        self.layout = layout
        self.draft = draft
        self.membership = membership
        self.transitions = PrefillTransitions(membership)
        self.max_queued = max_queued
        self.metrics = metrics or PrefillMetrics()
        self.transfer_options = transfer_options or TransferOptions()
        # No rings: make_sender picks gRPC even for a decode worker on this host.
        self.rings = ShmRingPool.for_options(self.transfer_options) if use_shm else None
        self.is_draining = False
        self._pools = engine.kv_pools
        self._push_slots = asyncio.Semaphore(max_concurrent_pushes)
        self._waiting: dict[str, asyncio.Future[_Prefilled]] = {}
        self._tasks: dict[str, asyncio.Task[Any]] = {}
        self._channels = channels or ChannelPool()  # to decode workers (cluster secret)
        self._relay = LayerRelay(
            asyncio.get_running_loop(),
            engine.device,
            engine.kv_pools,
            group_bytes=self.transfer_options.chunk_bytes,
        )
        engine.set_layer_listener(self._relay)  # before the engine thread starts
        self.engine_loop: EngineLoop[list[_Prefilled]] = EngineLoop(
            engine,
            asyncio.get_running_loop(),
            on_step=_collect,
            deliver=self._deliver,
            on_error=self._on_engine_error,
            max_queued_calls=max_queued,
            name="prefill-engine",
            thread=torch_thread,  # the thread that built the engine
        )

    # ---- RPCs

    async def Prefill(self, request: pb.PrefillRequest, context: Any) -> pb.PrefillReply:
        rid = request.request_id
        if self.is_draining:
            raise Unavailable("prefill worker: draining")
        if request.model and request.model != self.served_name:
            raise PreconditionFailed(f"model: this worker serves {self.served_name!r}")
        if rid in self._tasks:
            raise ValueError(f"request_id: {rid!r} is already being prefilled here")
        if len(self._tasks) >= self.max_queued:
            raise Overloaded(f"prefill queue: {self.max_queued} requests in flight; retry later")
        task = asyncio.current_task()
        assert task is not None
        started = time.monotonic()
        push = self._start_push(request, context.time_remaining())
        self._tasks[rid] = task
        try:
            params = params_from_proto(request.sampling)
            prompt = list(request.prompt_token_ids)
            future = self._waiting[rid] = asyncio.get_running_loop().create_future()
            # The push is registered on the engine thread, right after the add, so that it
            # sees only this attempt's layers: an earlier attempt of the same request id
            # (failed, its drop queued before this add) may still be in the step the
            # engine is running while the event loop starts this one.
            add = AddRequest(
                rid,
                prompt,
                params,
                is_prefill_only=True,
                num_output_tokens_sent=request.num_output_tokens_sent,
                then=functools.partial(self._relay.register, rid, push),
            )
            await _unless_push_failed(self.engine_loop.submit(add), push)
            queued = time.monotonic()
            result = await _unless_push_failed(future, push)
            num_prompt = len(prompt) - request.num_output_tokens_sent
            start = RequestStart(prompt[:num_prompt], params, prompt[num_prompt:])
            output = OutputBuilder(rid, start, self.engine.tokenizer).add(result.delta)
            assert output is not None  # its first delta
            if output.finish_reason is FinishReason.ERROR:
                raise RequestFailed(NON_FINITE_LOGITS)
            # A stop string in the first token's text ends the request too.
            prefilled = None if output.finished else result.prefilled
            computed = time.monotonic()
            role = self.metrics.role
            self.metrics.prefill_seconds.labels(role).observe(computed - queued)
            self.transitions.start_transfer(rid)
            num_bytes = 0
            if prefilled is not None:
                self.membership.claim(
                    rid, prefilled.block_table, has_draft=self.layout.draft is not None
                )
                num_bytes = await push.wait()  # what compute left: the last layers, finish
                self.metrics.kv_transfer_seconds.labels(role).observe(push.seconds)
                self.metrics.kv_transfer_bytes.labels(role).inc(num_bytes)
            else:
                await push.stop("the first token ended the request: no KV to hand on")
            self.transitions.hand_to_decode(rid, request.decode_worker_id, request.decode_epoch)
            timing = pb.PrefillTiming(
                queue_s=queued - started,
                compute_s=computed - queued,
                transfer_s=time.monotonic() - computed,
            )
            return self._reply(output, prefilled, params.logprobs, num_bytes, timing)
        finally:
            self._waiting.pop(rid, None)
            self._unrelay(rid, push)
            try:  # the blocks are freed only once the push reads no more of them
                await push.stop("prefill failed or was cancelled")
            finally:
                self._tasks.pop(rid, None)
                # Also its push's relay entry, if an add that the event loop stopped
                # waiting for registered it after all.
                drop = DropRequest(rid, then=functools.partial(self._unrelay, rid, push))
                self.engine_loop.submit(drop)
                self.membership.free(rid)

    async def Abort(self, request: pb.AbortRequest, context: Any) -> pb.AbortReply:
        task = self._tasks.get(request.request_id)
        if task is None:
            return pb.AbortReply(was_known=False)
        log.info("abort %s: %s", request.request_id, request.reason or "no reason given")
        task.cancel()  # Prefill's cleanup frees the blocks
        return pb.AbortReply(was_known=True)

    async def Stats(self, request: pb.StatsRequest, context: Any) -> pb.StatsReply:
        stats = self.engine_loop.stats
        reply = pb.StatsReply(
            role=pb.WORKER_ROLE_PREFILL,
            worker_id=self.membership.worker_id,
            epoch=self.membership.epoch,
            model=self.served_name,
            num_kv_blocks_used=stats.num_used_blocks,
            num_kv_blocks_free=stats.num_free_blocks,
            num_running=len(self._tasks),
            num_waiting=stats.num_waiting,
            load=self.load()[0],
            block_size=self.engine.config.block_size,
        )
        if self.draft is not None:
            reply.draft.CopyFrom(self.draft)
        if request.include_block_ids:
            await self.engine_loop.report_block_ids(reply)
        return reply

    # ---- lifecycle (serving.component.Service)

    def add_to(self, server: Any) -> None:
        pb_grpc.add_PrefillWorkerServicer_to_server(self, server)

    def start(self) -> None:
        self.engine_loop.start()

    async def housekeeping(self) -> None:
        """Connects to every registered decode worker ahead of its first push (each
        Prefill cleans up after itself: nothing else to do between requests)."""
        while True:
            try:
                decoders = self.membership.ledger.list_workers(WorkerRole.DECODE)
                self._channels.connect(w.address for w in decoders)
            except redis.RedisError as e:
                log.warning("listing decode workers: redis: %s", e)
            await asyncio.sleep(CONNECT_PERIOD_S)

    def load(self) -> tuple[float, dict[str, str | int | float]]:
        """Load and figures for heartbeats."""
        stats = self.engine_loop.stats
        load = max(stats.load, len(self._tasks) / self.max_queued)
        figures: dict[str, str | int | float] = {
            "model": self.served_name,
            "num_requests": len(self._tasks),
            "num_free_blocks": stats.num_free_blocks,
            "draining": int(self.is_draining),
            **draft_figures(self.draft),
        }
        return min(1.0, load), figures

    def on_lease_lost(self, request_id: str) -> None:
        """Nothing to drop at once: the hand-over to the decode worker at the end of the
        request's Prefill is refused by the ledger, which fails that Prefill."""

    def on_registered(self, epoch: int) -> None:
        """Registered again, prefills under way end as above; new ones use ``epoch``."""

    async def held_requests(self) -> list[HeldRequest]:
        """None to record again: the router prefills again what was in flight."""
        return []

    async def drain(self, timeout_s: float) -> None:
        """Refuses new prefills, waits for those in flight."""
        self.is_draining = True
        deadline = time.monotonic() + timeout_s
        while self._tasks and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    async def close(self) -> None:
        """Stops the engine thread, closes the channels to decode workers and the rings."""
        self.engine_loop.stop()
        await self._channels.close()
        if self.rings is not None:
            self.rings.close()

    # ---- internals

    def _start_push(self, request: pb.PrefillRequest, remaining_s: float | None) -> LayerPush:
        """Opens the push into the decode worker's blocks before any compute; the relay
        feeds it each layer the engine writes for this request. The push lives as long
        as the request may (its deadline), since it is open while the request queues; its
        engine clock fails it sooner if the engine stops writing layers altogether."""
        options = self.transfer_options
        if remaining_s is not None and remaining_s > options.timeout_s:
            options = dataclasses.replace(options, timeout_s=remaining_s)
        sender = make_sender(
            self._channels.get(request.decode_address),
            peer_host_id=request.decode_host_id or None,
            rings=self.rings,
            options=options,
        )
        push = LayerPush(
            sender,
            Handshake(request.request_id, self.layout, request.decode_epoch),
            self._pools,
            request.decode_block_ids,
            request.num_cached_blocks,
            self.engine.config.block_size,
            self._push_slots,
            options.stall_s,
            engine_progress=lambda: self._relay.last_written_at,
        )
        return push

    def _unrelay(self, rid: str, push: LayerPush) -> None:
        self._relay.unregister(rid, push)  # never a later attempt's push

    def _reply(
        self,
        output: RequestOutput,
        prefilled: PrefilledRequest | None,
        logprobs: int | None,
        num_bytes: int,
        timing: pb.PrefillTiming,
    ) -> pb.PrefillReply:
        reply = pb.PrefillReply(
            first_token_id=output.token_ids[-1] if output.token_ids else 0,  # 0: max_tokens 0
            # A resumed request's output holds its earlier tokens too: its text is not sent.
            first_text=output.text if len(output.token_ids) == 1 else "",
            draft_tokens=prefilled.draft_token_ids if prefilled else [],
            num_cached_tokens=output.num_cached_tokens,
            num_bytes_pushed=num_bytes,
            timing=timing,
            is_finished=output.finished,
        )
        if logprobs is not None and output.logprobs:
            reply.first_token_logprob.CopyFrom(token_logprob_to_proto(output.logprobs[-1]))
        for entry in output.prompt_logprobs or ():
            reply.prompt_logprobs.append(token_logprob_to_proto(entry))
        return reply

    def _deliver(self, results: list[_Prefilled]) -> None:
        for result in results:
            future = self._waiting.get(result.delta.request_id)
            if future is not None and not future.done():
                future.set_result(result)

    def _on_engine_error(self, error: BaseException) -> None:
        for future in self._waiting.values():
            if not future.done():
                future.set_exception(RuntimeError(f"engine step failed: {error}"))

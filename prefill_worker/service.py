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
from typing import Any, TypeVar

import redis

from engine.llm_engine import LLMEngine
from kv_transfer import (
    KV_WIRE_VERSION,
    Handshake,
    KvLayout,
    ShmRingPool,
    TransferOptions,
    make_sender,
)
from ledger.ledger import WorkerRole
from ledger.membership import HeldRequest, Membership
from prefill_worker.kv_push import LayerPush, LayerRelay
from prefill_worker.prefill_calls import (
    PrefillCalls,
    Prefilled,
    collect,
    first_output,
    prefill_reply,
)
from prefill_worker.transitions import PrefillTransitions
from serving.engine_commands import AddRequest, DropRequest
from serving.engine_loop import EngineLoop, TorchThread
from serving.engine_setup import draft_figures, rank_figures
from serving.lora_setup import lora_figure, request_lora
from serving.metrics import PrefillMetrics
from serving.rpc import ChannelPool
from serving.sampling import params_from_proto
from tandem.v1 import worker_pb2 as pb

log = logging.getLogger(__name__)

CONNECT_PERIOD_S = 2.0  # how often new decode workers are connected to ahead of use
T = TypeVar("T")


async def _unless_push_failed(future: asyncio.Future[T], push: LayerPush) -> T:
    """The engine's answer; a push that fails meanwhile (its engine clock ran out: the
    engine may not even take the request) fails the request at once."""
    waits: set[asyncio.Future[Any]] = {future, push.task}
    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    if push.task.done() and not future.done():
        push.task.result()  # raises the push's error (a push may also end first: all sent)
    return await future


class PrefillWorkerService(PrefillCalls):
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
        super().__init__(max_queued)
        self.engine = engine
        self.served_name = served_name
        self.layout = layout
        self.draft = draft
        self.membership = membership
        self.transitions = PrefillTransitions(membership)
        self.metrics = metrics or PrefillMetrics()
        self.transfer_options = transfer_options or TransferOptions()
        # No rings: make_sender picks gRPC even for a decode worker on this host.
        self.rings = ShmRingPool.for_options(self.transfer_options) if use_shm else None
        self._pools = engine.kv_pools
        self._push_slots = asyncio.Semaphore(max_concurrent_pushes)
        self._channels = channels or ChannelPool()  # to decode workers (cluster secret)
        self._relay = LayerRelay(
            asyncio.get_running_loop(),
            engine.device,
            engine.kv_pools,
            group_bytes=self.transfer_options.chunk_bytes,
        )
        engine.set_layer_listener(self._relay)  # before the engine thread starts
        self.engine_loop: EngineLoop[list[Prefilled]] = EngineLoop(
            engine,
            asyncio.get_running_loop(),
            on_step=collect,
            deliver=self._deliver,
            on_error=self._on_engine_error,
            max_queued_calls=max_queued,
            name="prefill-engine",
            thread=torch_thread,  # the thread that built the engine
        )

    # ---- RPCs

    async def Prefill(self, request: pb.PrefillRequest, context: Any) -> pb.PrefillReply:
        rid = request.request_id
        self._admit(request)
        started = time.monotonic()
        try:
            push = self._start_push(request, context.time_remaining())
        except BaseException:
            self._done(rid)
            raise
        try:
            params = params_from_proto(request.sampling)
            prompt = list(request.prompt_token_ids)
            future = self._first_token(rid)
            # The push is registered on the engine thread, right after the add, so that it
            # sees only this attempt's layers: an earlier attempt of the same request id
            # (failed, its drop queued before this add) may still be in the step the
            # engine is running while the event loop starts this one.
            lora, digest = request_lora(request.lora, request.lora_digest)
            add = AddRequest(
                rid,
                prompt,
                params,
                is_prefill_only=True,
                num_output_tokens_sent=request.num_output_tokens_sent,
                then=functools.partial(self._relay.register, rid, push),
                lora=lora,
                lora_digest=digest,
            )
            await _unless_push_failed(self.engine_loop.submit(add), push)
            queued = time.monotonic()
            result = await _unless_push_failed(future, push)
            output, prefilled = first_output(request, params, result, self.engine.tokenizer)
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
            return prefill_reply(output, prefilled, params.logprobs, num_bytes, timing)
        finally:
            self._unrelay(rid, push)
            try:  # the blocks are freed only once the push reads no more of them
                await push.stop("prefill failed or was cancelled")
            finally:
                self._done(rid)
                # Also its push's relay entry, if an add that the event loop stopped
                # waiting for registered it after all.
                drop = DropRequest(rid, then=functools.partial(self._unrelay, rid, push))
                self.engine_loop.submit(drop)
                self.membership.free(rid)

    # ---- lifecycle (serving.component.Service)

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
        figures: dict[str, str | int | float] = {
            "model": self.served_name,
            "num_requests": len(self._tasks),
            "num_free_blocks": stats.num_free_blocks,
            "draining": int(self.is_draining),
            "kv_wire_version": KV_WIRE_VERSION,  # routers pair workers of one version
            **rank_figures(self.engine, stats),
            **draft_figures(self.draft),
            **lora_figure(self.loras),
        }
        return self._load(), figures

    def on_lease_lost(self, request_id: str) -> None:
        """Nothing to drop at once: the hand-over to the decode worker at the end of the
        request's Prefill is refused by the ledger, which fails that Prefill."""

    def on_registered(self, epoch: int) -> None:
        """Registered again, prefills under way end as above; new ones use ``epoch``."""

    async def held_requests(self) -> list[HeldRequest]:
        """None to record again: the router prefills again what was in flight."""
        return []

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
            pools_on_gpu=str(self.engine.config.device).startswith("cuda"),
            peer_pools_bus_id=request.decode_kv_pools_bus_id,
        )
        push = LayerPush(
            sender,
            Handshake(
                request.request_id,
                self.layout,
                request.decode_epoch,
                request.lora,
                request.lora_digest,
            ),
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

"""tandem.v1.Generation: validate, pick P and D, record the request in the ledger, then
D.Reserve -> P.Prefill (P pushes the KV into D's blocks) -> D.Decode, streaming D's
chunks to the client; a first attempt's first token leaves with P's reply, before D.Decode.
A co-located worker is P and D in one process: the same three hops, its P computing the
KV into the blocks its D reserved (an in-process channel, no push). Cancels and deadlines
abort it on P and D; however it ends, it is terminal in the ledger, blocks freed."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Coroutine
from typing import Any

import grpc  # type: ignore[import-untyped]  # no types-grpcio in the dev extra
import redis

from ledger.ledger import Ledger, RequestState, WorkerInfo, WorkerRole
from ledger.membership import Membership
from router.lora_admin import LoraAdmin
from router.migration import Migration, abort_on
from router.route import Route, StreamTiming, how_it_ended
from router.routing import WorkerPicker, prefix_hashes
from router.transitions import RouterTransitions
from router.validation import RequestValidator
from serving.metrics import RouterMetrics
from serving.rpc import ChannelPool, Overloaded, Unavailable, status_of
from tandem.v1 import generation_pb2 as gen
from tandem.v1 import generation_pb2_grpc as gen_grpc
from tandem.v1 import worker_pb2 as pb
from tandem.v1 import worker_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

RESERVE_TIMEOUT_S = 10.0
# A picked prefill worker's channel must be ready within this: one restarted at the same
# address is reached at the channel's next reconnection (at most 1 s apart, rpc.py).
PREFILL_CONNECT_S = 3.0
MAX_ATTEMPTS = 8  # one request's prefills: the first, then resumptions (preempted, D lost)
RESERVE_BACKOFF_S = (0.02, 0.5)  # first and longest wait between refused reservations
# A Decode call refused before its first chunk with these: D no longer holds the
# reservation (it restarted, re-registered at a new epoch, or dropped it when the ledger
# lost data or its lease lapsed). The request is prefilled again, not failed.
LOST_RESERVATION = (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION)
# A request that fails with these may be sent again, under the same id (the SDK retries
# UNAVAILABLE; RESOURCE_EXHAUSTED says when to).
RETRIED_BY_CLIENTS = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)


class GenerationService(gen_grpc.GenerationServicer):
    """The router's ``tandem.v1.Generation``: admits a request (or refuses it: draining,
    overloaded, invalid), picks its P and D (``WorkerPicker``), then runs the three hops
    (see the module's docstring) as attempts: a request preempted on D, or whose P or D
    fails, is taken back and resumed on new ones (``Migration``), up to MAX_ATTEMPTS.
    Its ledger transitions go through ``RouterTransitions``."""

    def __init__(
        self,
        *,
        validator: RequestValidator,
        picker: WorkerPicker,
        membership: Membership,
        draft_dir_name: str = "",
        default_timeout_s: float = 600.0,
        metrics: RouterMetrics | None = None,
        channels: ChannelPool | None = None,
        max_in_flight: int = 1024,
        max_waiting: int = 256,
    ) -> None:
        self.validator = validator
        # Bounds: requests admitted, and of those, requests waiting for KV room on a
        # decode worker. Beyond either a request is refused (RESOURCE_EXHAUSTED).
        self.max_in_flight, self.max_waiting = max_in_flight, max_waiting
        self.num_waiting = 0
        self.picker = picker
        self.membership = membership
        self.ledger: Ledger = membership.ledger
        self.draft_dir_name = draft_dir_name
        self.default_timeout_s = default_timeout_s
        self.metrics = metrics or RouterMetrics()
        self.is_draining = False
        self.num_in_flight = 0
        role = self.metrics.role  # both counts read when scraped
        self.metrics.in_flight.labels(role).set_function(lambda: self.num_in_flight)
        self.metrics.waiting.labels(role).set_function(lambda: self.num_waiting)
        for gauge, worker_role in (
            (self.metrics.prefill_workers, WorkerRole.PREFILL),
            (self.metrics.decode_workers, WorkerRole.DECODE),
        ):
            gauge.labels(role).set_function(functools.partial(picker.num_workers, worker_role))
        self.metrics.lora_adapters.labels(role).set_function(picker.num_loras)
        self._channels = channels or ChannelPool()  # to workers (with the cluster secret)
        self.lora_admin = LoraAdmin(picker, self._channels, validator.model.name)
        self._cleanups: set[asyncio.Task[None]] = set()
        self.transitions = RouterTransitions(membership, validator.model.name)
        self.migration = Migration(
            transitions=self.transitions,
            picker=picker,
            channels=self._channels,
            metrics=self.metrics,
        )

    # ---- RPCs

    async def Generate(
        self, request: gen.GenerateRequest, context: Any
    ) -> AsyncGenerator[gen.GenerateChunk, None]:
        arrived = time.monotonic()
        admitted = 0
        try:
            if self.is_draining:
                raise Unavailable("router: draining; retry on another router")
            if self.num_in_flight >= self.max_in_flight:
                raise Overloaded(
                    f"router: {self.max_in_flight} requests in flight (--max-in-flight); "
                    "retry later"
                )
            admitted = 1  # counted from here: picking may wait for a worker
            self.num_in_flight += admitted
            valid = self.validator.validate(request)
            remaining = context.time_remaining()
            timeout = self.default_timeout_s if remaining is None else remaining
            hashes = prefix_hashes(valid.prompt_token_ids, lora=valid.lora)
            prefill, decode = await self.picker.pick_waiting(
                arrived + timeout, hashes, lora=valid.lora
            )
            route = Route(valid, prefill, decode, arrived + timeout)
            rid = valid.request_id
            self.transitions.record(route)
        except BaseException:
            self.num_in_flight -= admitted
            self.metrics.requests.labels(self.metrics.role, "rejected").inc()
            raise
        self.picker.count_in_flight(route.workers, +1)
        is_finished = is_ended = False
        end_state, reason = RequestState.FAILED, ""
        model = valid.lora or self.validator.model.name
        timing = StreamTiming(self.metrics, arrived, model, len(valid.prompt_token_ids))
        try:
            for attempt in range(MAX_ATTEMPTS):
                if attempt:  # D handed it back: resume it, prompt + tokens sent so far
                    await self.migration.repick(route)
                reserve = await self._reserve(route)
                try:
                    self.picker.remember((route.prefill, route.decode), hashes)
                except redis.RedisError as e:  # a routing hint lost, not the request
                    log.warning("prefix index: redis: %s", e)
                prefill_called = time.monotonic()
                num_sent_before = len(route.output_tokens_sent)
                try:
                    prefilled = await self._prefill(route, reserve)  # nothing when co-located
                except (grpc.aio.AioRpcError, Unavailable) as e:
                    # UNAVAILABLE: P died, or D let the blocks go. ABORTED: P refused a
                    # ledger step, e.g. the request names an epoch P has left behind (P
                    # registered again after a stall, and this router picked it before).
                    is_retried = isinstance(e, Unavailable) or e.code() in (
                        grpc.StatusCode.UNAVAILABLE,
                        grpc.StatusCode.ABORTED,
                        grpc.StatusCode.FAILED_PRECONDITION,  # P lacks the adapter: a race
                    )
                    if not is_retried or attempt + 1 == MAX_ATTEMPTS:
                        raise
                    await self.migration.requeue_after_failed_prefill(route, e)
                    continue
                if not attempt:
                    timing.queued(prefill_called + prefilled.timing.queue_s)
                first = route.first_chunk(prefilled)
                if first is not None:
                    route.output_tokens_sent.extend(first.token_ids)
                    timing.sent(first)
                    yield first
                    num_sent_before = len(route.output_tokens_sent)  # what D's stream has to add
                try:
                    async for chunk in self._decode(
                        route, reserve, prefilled, is_first_token_sent=first is not None
                    ):
                        if chunk.finish_reason == gen.FINISH_REASON_PREEMPTED:
                            route.count_attempt(chunk.usage)
                            continue  # the stream's last chunk: resume it below
                        route.output_tokens_sent.extend(chunk.token_ids)
                        is_finished = chunk.finish_reason != gen.FINISH_REASON_UNSPECIFIED
                        if is_finished:
                            route.with_earlier_attempts(chunk)
                        timing.sent(chunk)
                        yield chunk
                except grpc.aio.AioRpcError as e:
                    if attempt + 1 == MAX_ATTEMPTS:
                        raise
                    if e.code() == grpc.StatusCode.UNAVAILABLE:
                        await self.migration.requeue_after_lost_decode(route, e)  # elsewhere
                    elif (
                        e.code() in LOST_RESERVATION
                        and len(route.output_tokens_sent) == num_sent_before
                    ):
                        await self.migration.requeue_after_lost_reservation(route, e)
                    else:
                        raise
                    continue
                if is_finished:
                    return
                log.info(
                    "%s preempted on %s after %d tokens",
                    rid,
                    route.decode.worker_id,
                    len(route.output_tokens_sent),
                )
            raise Overloaded(
                f"request interrupted {MAX_ATTEMPTS} times (preempted for lack of KV blocks, "
                "or its decode worker lost); retry later"
            )
        except BaseException as e:
            end_state, reason = how_it_ended(e, route)
            error: BaseException = e
            if end_state is RequestState.FAILED and self.transitions.is_forgotten(rid):
                error = Unavailable(
                    f"request {rid}: the ledger lost its record while it ran (its Redis "
                    f"restarted?); retry. ({reason})"
                )
            if end_state is RequestState.FAILED:
                # Ended before the client hears of it: a retry with the same id must find
                # neither this attempt's record live nor its Aborts still to come.
                retryable = status_of(error)[0] in RETRIED_BY_CLIENTS
                try:
                    await self._end(route, end_state, reason, retryable=retryable)
                    is_ended = True
                except Exception as cleanup:  # Redis unreachable: the client's error stands
                    log.warning("%s: not ended before answering: %s", rid, cleanup)
            if error is e:
                raise
            raise error from e
        finally:
            self.num_in_flight -= 1
            self.picker.count_in_flight(route.workers, -1)
            if not is_finished and not is_ended:
                # A task of its own: this one may be cancelled again while it cleans up.
                self._spawn(self._end(route, end_state, reason))
            timing.ended("finished" if is_finished else end_state.value.lower())

    async def ListModels(
        self, request: gen.ListModelsRequest, context: Any
    ) -> gen.ListModelsResponse:
        model = self.validator.model
        info = gen.ModelInfo(name=model.name, max_model_len=model.max_model_len)
        for worker in self.picker.workers(WorkerRole.DECODE)[:1]:
            info.draft_model = worker.stats.get("draft_model", "")
            info.draft_kind = worker.stats.get("draft_kind", "")
        if not info.draft_model and self.draft_dir_name:
            info.draft_model = self.draft_dir_name
        models = [info]
        for name in self.picker.lora_names():  # its LoRA adapters, the model their parent
            models.append(gen.ModelInfo())
            models[-1].CopyFrom(info)
            models[-1].name, models[-1].parent = name, model.name
        return gen.ListModelsResponse(models=models)

    # ---- the three hops

    async def _reserve(self, route: Route) -> pb.ReserveReply:
        """D holds blocks for the prompt; then the request is handed to P in the ledger.

        A decode worker without room (RESOURCE_EXHAUSTED) or unreachable (UNAVAILABLE) is
        passed over for the others; when every one is full, the request waits with growing
        pauses until one has room or the deadline comes."""
        valid = route.request
        ids = route.token_ids
        request = pb.ReserveRequest(
            request_id=valid.request_id,
            model=self.validator.model.name,
            num_prompt_tokens=len(ids),
            prompt_token_ids=ids,
            sampling=valid.sampling,
            draft_fingerprint=route.prefill.stats.get("draft_fingerprint", ""),
            num_output_tokens_sent=len(route.output_tokens_sent),
            router_id=self.membership.worker_id,
            router_epoch=route.owner_epoch,  # a preempted request comes back to it
            lora=valid.lora,
            lora_digest=route.lora_digest,
        )
        full: set[str] = set()
        refused: set[str] = set()  # answered FAILED_PRECONDITION
        pause = RESERVE_BACKOFF_S[0]
        is_waiting = False  # counted in num_waiting: found every decode worker full
        try:
            while True:
                try:
                    reply: pb.ReserveReply = await self._decoder(route).Reserve(
                        request, timeout=min(RESERVE_TIMEOUT_S, route.remaining())
                    )
                    self.picker.mark_reachable(route.decode)  # even if an earlier call failed
                    break
                except grpc.aio.AioRpcError as e:
                    if e.code() == grpc.StatusCode.UNAVAILABLE:  # died since its heartbeat
                        self.picker.mark_unreachable(route.decode)
                    elif e.code() == grpc.StatusCode.FAILED_PRECONDITION:
                        # It does not serve the request as its heartbeat said (an adapter
                        # unloaded, a restart with another draft): not this one again.
                        refused.add(route.decode.worker_id)
                        self.picker.forget_stale()
                        if not self._other_decoders(route, refused):
                            raise
                    elif e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                        raise
                    full.add(route.decode.worker_id)
                others = self._other_decoders(route, full | refused)
                if not others:  # all full: wait, then try them all again
                    if not is_waiting:
                        self._start_waiting()
                        is_waiting = True
                    await asyncio.sleep(min(pause, route.remaining()))
                    pause = min(2 * pause, RESERVE_BACKOFF_S[1])
                    full.clear()
                    self.picker.forget_stale()
                    others = self._other_decoders(route, refused)
                if others:
                    self.picker.count_in_flight(route.workers, -1)
                    is_colocated = route.is_colocated
                    route.decode = self.picker.least_loaded(others, route.avoid)
                    if is_colocated:  # another co-located worker: its own P and D
                        route.prefill = route.decode
                    self.picker.count_in_flight(route.workers, +1)
        finally:
            self.num_waiting -= is_waiting
        self.transitions.hand_to_prefill(route)
        return reply

    def _other_decoders(self, route: Route, passed_over: set[str]) -> list[WorkerInfo]:
        """Decode workers that take ``route``'s KV (and serve its adapter), less those in
        ``passed_over``."""
        decoders = self.picker.decoders_for(route.prefill, route.request.lora)
        return [w for w in decoders if w.worker_id not in passed_over]

    def _start_waiting(self) -> None:
        """A request found every decode worker full: it waits for room (counted until it
        has its blocks or ends) while fewer than ``max_waiting`` others do; else
        Overloaded, with a hint of the longest pause."""
        if self.num_waiting >= self.max_waiting:
            raise Overloaded(
                f"router: {self.max_waiting} requests already wait for KV room on the decode "
                "workers (--max-waiting); retry later",
                retry_after_s=RESERVE_BACKOFF_S[1] * 2,
            )
        self.num_waiting += 1

    async def _prefill(self, route: Route, reserve: pb.ReserveReply) -> pb.PrefillReply:
        """P computes the prompt and pushes its KV into D's blocks (P hands it to D); a
        co-located P computes it into them in place."""
        channel = self._channels.get(route.prefill.address)
        await self._connect(channel, route)
        reply: pb.PrefillReply = await pb_grpc.PrefillWorkerStub(channel).Prefill(
            route.prefill_request(self.validator.model.name, reserve), timeout=route.remaining()
        )
        return reply

    async def _connect(self, channel: grpc.aio.Channel, route: Route) -> None:
        """Waits for P's channel to be ready. Only P failing to connect within
        PREFILL_CONNECT_S is evidence against P (Unavailable: the caller passes P over);
        the request's own deadline running out first is a TimeoutError (DEADLINE_EXCEEDED)."""
        if channel.get_state(try_to_connect=True) is grpc.ChannelConnectivity.READY:
            return
        wait_s = min(PREFILL_CONNECT_S, route.remaining())
        if wait_s <= 0:
            raise TimeoutError(f"request {route.request.request_id}: its deadline passed")
        try:
            await asyncio.wait_for(channel.channel_ready(), wait_s)
        except TimeoutError:
            if wait_s < PREFILL_CONNECT_S:
                raise TimeoutError(
                    f"request {route.request.request_id}: its deadline passed while connecting "
                    f"to prefill worker {route.prefill.worker_id}"
                ) from None
            raise Unavailable(
                f"prefill worker {route.prefill.worker_id} at {route.prefill.address}: "
                f"not reachable within {PREFILL_CONNECT_S:g} s"
            ) from None

    async def _decode(
        self,
        route: Route,
        reserve: pb.ReserveReply,
        prefilled: pb.PrefillReply,
        *,
        is_first_token_sent: bool = False,
    ) -> AsyncIterator[gen.GenerateChunk]:
        """D's chunks, checked to be contiguous, up to and including the last one."""
        request = pb.DecodeRequest(
            request_id=route.request.request_id,
            epoch=reserve.epoch,
            first_token_id=prefilled.first_token_id,
            draft_tokens=prefilled.draft_tokens,
            is_finished_on_prefill=prefilled.is_finished,
            is_first_token_sent=is_first_token_sent,
            first_text=prefilled.first_text if is_first_token_sent else "",
        )
        if prefilled.HasField("first_token_logprob"):
            request.first_token_logprob.CopyFrom(prefilled.first_token_logprob)
        call = self._decoder(route).Decode(request, timeout=route.remaining())
        num_sent = len(route.output_tokens_sent)
        # max_tokens 0 (prompt logprobs only) takes this same path: D reserved, P scores the
        # prompt and ends the request (is_finished), D answers one LENGTH chunk and frees the
        # reservation at once. Reserving a prompt's blocks for nothing is the price of one
        # path through the ledger's states and D's usage; such requests are rare.
        prompt_logprobs = prefilled.prompt_logprobs if not num_sent else None  # on chunk one
        try:
            async for chunk in call:
                if chunk.index != num_sent:
                    raise RuntimeError(f"decode stream: chunk index {chunk.index}, want {num_sent}")
                if prompt_logprobs and chunk.finish_reason != gen.FINISH_REASON_PREEMPTED:
                    chunk.prompt_logprobs.extend(prompt_logprobs)
                    prompt_logprobs = None
                num_sent += len(chunk.token_ids)
                if chunk.finish_reason == gen.FINISH_REASON_PREEMPTED:
                    yield chunk
                    return
                if chunk.finish_reason != gen.FINISH_REASON_UNSPECIFIED:
                    chunk.usage.cached_tokens = prefilled.num_cached_tokens
                    yield chunk
                    return
                yield chunk
            raise RuntimeError("decode stream: ended without a last chunk")
        finally:
            call.cancel()  # no-op once the stream ended; else D stops decoding at once

    # ---- lifecycle

    def is_ready(self) -> bool:
        """Whether a request sent now could be served without waiting for a worker to
        start: not draining, and a warm worker pair is live (``WorkerPicker.is_ready``)."""
        return not self.is_draining and self.picker.is_ready()

    def load(self) -> tuple[float, dict[str, str | int | float]]:
        return 0.0, {"num_in_flight": self.num_in_flight, "draining": int(self.is_draining)}

    async def reap_expired_leases(self, period_s: float) -> None:
        """Takes back in the ledger the blocks of workers that stopped renewing their leases
        (they died: their memory went with them). Migration of their requests is not done.
        Also connects to every registered worker ahead of its first request."""
        while True:
            try:
                self._channels.connect(w.address for w in self.ledger.list_workers())
            except redis.RedisError as e:
                log.warning("listing workers: redis: %s", e)
            await asyncio.sleep(period_s)
            try:
                for reclaimed in self.transitions.reclaim_expired():
                    log.warning(
                        "lease of %s on %s expired: its blocks were reclaimed",
                        reclaimed.worker_id,
                        reclaimed.request_id,
                    )
            except redis.RedisError as e:
                log.warning("reaper: redis: %s", e)

    async def drain(self, timeout_s: float) -> None:
        self.is_draining = True
        self.picker.close()  # requests waiting for workers go to another router now
        deadline = time.monotonic() + timeout_s
        while (self.num_in_flight or self._cleanups) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    async def close(self) -> None:
        await self._channels.close()

    # ---- internals

    def _decoder(self, route: Route) -> pb_grpc.DecodeWorkerStub:
        return pb_grpc.DecodeWorkerStub(self._channels.get(route.decode.address))

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._cleanups.add(task)
        task.add_done_callback(self._cleanups.discard)

    async def _end(
        self, route: Route, state: RequestState, reason: str, *, retryable: bool = False
    ) -> None:
        """Aborts the request on P and D (idempotent there) and ends it in the ledger;
        ``retryable``: its client was told to retry, so the id may be used again."""
        rid = route.request.request_id
        log.info("%s %s: %s", rid, state.value.lower(), reason)
        await abort_on(self._channels, route.workers, rid, reason)
        self.transitions.end(rid, state, reason, retryable=retryable)

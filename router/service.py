"""tandem.v1.Generation: validate, pick P and D, record the request in the ledger, then
D.Reserve -> P.Prefill (P pushes the KV into D's blocks) -> D.Decode, streaming D's
chunks to the client. Cancellation and deadlines reach P and D (Abort); every way a
request ends leaves it terminal in the ledger and its blocks freed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass, field
from typing import Any

import grpc  # type: ignore[import-untyped]  # no types-grpcio in the dev extra
import redis

from ledger.ledger import Ledger, LedgerConflict, RequestState, WorkerInfo, WorkerRole
from ledger.membership import Membership
from router.routing import WorkerPicker, prefix_hashes
from router.validation import RequestValidator, ValidRequest
from serving.metrics import RouterMetrics
from serving.rpc import ChannelPool, Overloaded, Unavailable, kv_push_status
from tandem.v1 import generation_pb2 as gen
from tandem.v1 import generation_pb2_grpc as gen_grpc
from tandem.v1 import worker_pb2 as pb
from tandem.v1 import worker_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

ABORT_TIMEOUT_S = 2.0
RESERVE_TIMEOUT_S = 10.0
# A picked prefill worker's channel must be ready within this: one restarted at the same
# address is reached at the channel's next reconnection (at most 1 s apart, rpc.py).
PREFILL_CONNECT_S = 3.0
DEADLINE_SLACK_S = 0.05  # errors this close to the deadline are the deadline's doing
MAX_ATTEMPTS = 8  # one request's prefills: the first, then resumptions (preempted, D lost)
# How long a request that lost its decode worker waits for a live one (the only one may be
# restarting: `tandem serve` restarts a dead worker within seconds); new requests wait the
# picker's wait_s.
RESUME_WAIT_S = 30.0
RESERVE_BACKOFF_S = (0.02, 0.5)  # first and longest wait between refused reservations


@dataclass
class _Route:
    """One request's path through the cluster."""

    request: ValidRequest
    prefill: WorkerInfo
    decode: WorkerInfo
    deadline: float  # time.monotonic()
    sent: list[int] = field(default_factory=list)  # completion ids streamed to the client
    # This router's epoch in the ledger record while the router owns it, and the one a
    # decode worker hands a preempted request back at; kept when the router registers
    # again after a Redis restart (a record the decode worker rebuilt carries it on).
    owner_epoch: int = 0

    @property
    def token_ids(self) -> list[int]:
        """What P prefills and D holds: the prompt, then any output already sent (a request
        resumed after a preemption)."""
        return self.request.prompt_token_ids + self.sent

    def remaining(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("deadline: exceeded before the request finished")
        return left


def _how_it_ended(error: BaseException, route: _Route) -> tuple[RequestState, str]:
    """CANCELLED past the deadline or on cancellation, else FAILED, with the reason."""
    if time.monotonic() >= route.deadline - DEADLINE_SLACK_S:
        return RequestState.CANCELLED, "deadline"
    if isinstance(error, asyncio.CancelledError | GeneratorExit):  # the client went away
        return RequestState.CANCELLED, "cancelled"
    if isinstance(error, grpc.aio.AioRpcError):
        return RequestState.FAILED, f"{error.code().name}: {error.details()}"
    return RequestState.FAILED, f"{type(error).__name__}: {error}"


class _StreamTiming:
    """One request's latencies, into the router's histograms."""

    def __init__(self, metrics: RouterMetrics, arrived: float) -> None:
        self.metrics = metrics
        self.arrived = arrived
        self.last_sent: float | None = None

    def queued(self, computing_since: float) -> None:
        self.metrics.queue_seconds.labels(self.metrics.role).observe(
            max(0.0, computing_since - self.arrived)
        )

    def sent(self, chunk: gen.GenerateChunk) -> None:
        if not chunk.token_ids:
            return
        now, role = time.monotonic(), self.metrics.role
        if self.last_sent is None:
            self.metrics.ttft_seconds.labels(role).observe(now - self.arrived)
        else:
            self.metrics.inter_token_seconds.labels(role).observe(now - self.last_sent)
        self.last_sent = now

    def ended(self, status: str) -> None:
        role = self.metrics.role
        self.metrics.e2e_seconds.labels(role).observe(time.monotonic() - self.arrived)
        self.metrics.requests.labels(role, status).inc()


class GenerationService(gen_grpc.GenerationServicer):
    def __init__(
        self,
        *,
        validator: RequestValidator,
        picker: WorkerPicker,
        membership: Membership,
        draft_dir_name: str = "",
        default_timeout_s: float = 600.0,
        metrics: RouterMetrics | None = None,
    ) -> None:
        self.validator = validator
        self.picker = picker
        self.membership = membership
        self.ledger: Ledger = membership.ledger
        self.draft_dir_name = draft_dir_name
        self.default_timeout_s = default_timeout_s
        self.metrics = metrics or RouterMetrics()
        self.is_draining = False
        self.num_in_flight = 0
        self._channels = ChannelPool()
        self._cleanups: set[asyncio.Task[None]] = set()

    # ---- RPCs

    async def Generate(
        self, request: gen.GenerateRequest, context: Any
    ) -> AsyncIterator[gen.GenerateChunk]:
        arrived = time.monotonic()
        try:
            if self.is_draining:
                raise Unavailable("router: draining; retry on another router")
            valid = self.validator.validate(request)
            remaining = context.time_remaining()
            timeout = self.default_timeout_s if remaining is None else remaining
            hashes = prefix_hashes(valid.prompt_token_ids)
            prefill, decode = await self.picker.pick_waiting(arrived + timeout, hashes)
            route = _Route(valid, prefill, decode, arrived + timeout)
            rid = valid.request_id
            self._create_in_ledger(route)
        except BaseException:
            self.metrics.requests.labels(self.metrics.role, "rejected").inc()
            raise
        self.num_in_flight += 1
        self._count_in_flight(route, +1)
        is_finished = False
        end_state, reason = RequestState.FAILED, ""
        timing = _StreamTiming(self.metrics, arrived)
        try:
            for attempt in range(MAX_ATTEMPTS):
                if attempt:  # D handed it back: resume it, prompt + tokens sent so far
                    await self._repick(route)
                reserve = await self._reserve(route)
                try:
                    self.picker.remember((route.prefill, route.decode), hashes)
                except redis.RedisError as e:  # a routing hint lost, not the request
                    log.warning("prefix index: redis: %s", e)
                prefill_called = time.monotonic()
                try:
                    prefilled = await self._prefill(route, reserve)
                except (grpc.aio.AioRpcError, Unavailable) as e:
                    # UNAVAILABLE: P died, or D let the blocks go. ABORTED: P refused a
                    # ledger step, e.g. the request names an epoch P has left behind (P
                    # registered again after a stall, and this router picked it before).
                    is_retried = isinstance(e, Unavailable) or e.code() in (
                        grpc.StatusCode.UNAVAILABLE,
                        grpc.StatusCode.ABORTED,
                    )
                    if not is_retried or attempt + 1 == MAX_ATTEMPTS:
                        raise
                    await self._take_back_from_prefill(route, e)
                    continue
                if not attempt:
                    timing.queued(prefill_called + prefilled.timing.queue_s)
                try:
                    async for chunk in self._decode(route, reserve, prefilled):
                        if chunk.finish_reason == gen.FINISH_REASON_PREEMPTED:
                            continue  # the stream's last chunk: resume it below
                        route.sent.extend(chunk.token_ids)
                        is_finished = chunk.finish_reason != gen.FINISH_REASON_UNSPECIFIED
                        timing.sent(chunk)
                        yield chunk
                except grpc.aio.AioRpcError as e:
                    if e.code() != grpc.StatusCode.UNAVAILABLE or attempt + 1 == MAX_ATTEMPTS:
                        raise
                    await self._take_back(route, e)  # D is gone: resume it elsewhere
                    continue
                if is_finished:
                    return
                log.info(
                    "%s preempted on %s after %d tokens",
                    rid,
                    route.decode.worker_id,
                    len(route.sent),
                )
            raise Overloaded(
                f"request interrupted {MAX_ATTEMPTS} times (preempted for lack of KV blocks, "
                "or its decode worker lost); retry later"
            )
        except BaseException as e:
            end_state, reason = _how_it_ended(e, route)
            if end_state is RequestState.FAILED and self._is_forgotten(rid):
                raise Unavailable(
                    f"request {rid}: the ledger lost its record while it ran (its Redis "
                    f"restarted?); retry. ({reason})"
                ) from e
            raise
        finally:
            self.num_in_flight -= 1
            self._count_in_flight(route, -1)
            if not is_finished:
                # A task of its own: this one may be cancelled again while it cleans up.
                self._spawn(self._abandon(route, end_state, reason))
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
        return gen.ListModelsResponse(models=[info])

    # ---- the three hops

    def _create_in_ledger(self, route: _Route) -> None:
        """Records the request, QUEUED and owned by this router (at its current epoch)."""
        valid = route.request
        route.owner_epoch = self.membership.epoch
        self.ledger.create_request(
            valid.request_id,
            owner=self.membership.worker_id,
            epoch=route.owner_epoch,
            fields={
                "model": self.validator.model.name,
                "num_prompt_tokens": len(valid.prompt_token_ids),
                "prefill_worker": route.prefill.worker_id,
                "decode_worker": route.decode.worker_id,
            },
        )

    async def _reserve(self, route: _Route) -> pb.ReserveReply:
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
            num_output_tokens_sent=len(route.sent),
            router_id=self.membership.worker_id,
            router_epoch=route.owner_epoch,  # a preempted request comes back to it
        )
        full: set[str] = set()
        pause = RESERVE_BACKOFF_S[0]
        while True:
            try:
                reply: pb.ReserveReply = await self._decoder(route).Reserve(
                    request, timeout=min(RESERVE_TIMEOUT_S, route.remaining())
                )
                self.picker.mark_reachable(route.decode)  # even if an earlier call failed
                break
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.UNAVAILABLE:  # died since its last heartbeat
                    self.picker.mark_unreachable(route.decode)
                elif e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                    raise
                full.add(route.decode.worker_id)
            others = [w for w in self.picker.decoders_for(route.prefill) if w.worker_id not in full]
            if not others:  # all full: wait, then try them all again
                await asyncio.sleep(min(pause, route.remaining()))
                pause = min(2 * pause, RESERVE_BACKOFF_S[1])
                full.clear()
                self.picker.forget_stale()
                others = self.picker.decoders_for(route.prefill)
            if others:
                self._count_in_flight(route, -1)
                route.decode = self.picker.least_loaded(others)
                self._count_in_flight(route, +1)
        self.ledger.transition(
            valid.request_id,
            RequestState.PREFILLING,
            expected=RequestState.QUEUED,
            epoch=route.owner_epoch,
            new_owner=route.prefill.worker_id,
            new_epoch=route.prefill.epoch,
        )
        return reply

    async def _prefill(self, route: _Route, reserve: pb.ReserveReply) -> pb.PrefillReply:
        """P computes the prompt and pushes its KV into D's blocks (P hands it to D)."""
        valid = route.request
        channel = self._channels.get(route.prefill.address)
        try:
            await asyncio.wait_for(
                channel.channel_ready(), min(PREFILL_CONNECT_S, max(route.remaining(), 0.0))
            )
        except TimeoutError:
            raise Unavailable(
                f"prefill worker {route.prefill.worker_id} at {route.prefill.address}: "
                f"not reachable within {PREFILL_CONNECT_S:g} s"
            ) from None
        reply: pb.PrefillReply = await pb_grpc.PrefillWorkerStub(channel).Prefill(
            pb.PrefillRequest(
                request_id=valid.request_id,
                model=self.validator.model.name,
                prompt_token_ids=route.token_ids,
                sampling=valid.sampling,
                decode_address=route.decode.address,
                decode_block_ids=reserve.block_ids,
                num_cached_blocks=reserve.num_cached_blocks,
                decode_epoch=reserve.epoch,
                decode_worker_id=route.decode.worker_id,
                decode_host_id=reserve.host_id,
                num_output_tokens_sent=len(route.sent),
            ),
            timeout=route.remaining(),
        )
        return reply

    async def _decode(
        self, route: _Route, reserve: pb.ReserveReply, prefilled: pb.PrefillReply
    ) -> AsyncIterator[gen.GenerateChunk]:
        """D's chunks, checked to be contiguous, up to and including the last one."""
        request = pb.DecodeRequest(
            request_id=route.request.request_id,
            epoch=reserve.epoch,
            first_token_id=prefilled.first_token_id,
            draft_tokens=prefilled.draft_tokens,
            is_finished_on_prefill=prefilled.is_finished,
        )
        if prefilled.HasField("first_token_logprob"):
            request.first_token_logprob.CopyFrom(prefilled.first_token_logprob)
        call = self._decoder(route).Decode(request, timeout=route.remaining())
        num_sent = len(route.sent)
        try:
            async for chunk in call:
                if chunk.index != num_sent:
                    raise RuntimeError(f"decode stream: chunk index {chunk.index}, want {num_sent}")
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

    def load(self) -> tuple[float, dict[str, str | int | float]]:
        return 0.0, {"num_in_flight": self.num_in_flight, "draining": int(self.is_draining)}

    async def reap_expired_leases(self, period_s: float) -> None:
        """Takes back in the ledger the blocks of workers that stopped renewing their leases
        (they died: their memory went with them). Migration of their requests is not done."""
        while True:
            await asyncio.sleep(period_s)
            try:
                for reclaimed in self.ledger.reap_expired():
                    log.warning(
                        "lease of %s on %s expired: its blocks were reclaimed",
                        reclaimed.worker_id,
                        reclaimed.request_id,
                    )
            except redis.RedisError as e:
                log.warning("reaper: redis: %s", e)

    async def drain(self, timeout_s: float) -> None:
        self.is_draining = True
        deadline = time.monotonic() + timeout_s
        while (self.num_in_flight or self._cleanups) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    async def close(self) -> None:
        await self._channels.close()

    # ---- internals

    def _decoder(self, route: _Route) -> pb_grpc.DecodeWorkerStub:
        return pb_grpc.DecodeWorkerStub(self._channels.get(route.decode.address))

    def _prefiller(self, route: _Route) -> pb_grpc.PrefillWorkerStub:
        return pb_grpc.PrefillWorkerStub(self._channels.get(route.prefill.address))

    def _count_in_flight(self, route: _Route, delta: int) -> None:
        for worker in (route.prefill, route.decode):
            self.picker.in_flight[worker.worker_id] += delta

    async def _repick(self, route: _Route) -> None:
        """New P and D for a request its decode worker handed back (the ledger has it
        QUEUED and owned by this router again); waits up to RESUME_WAIT_S for them."""
        self._count_in_flight(route, -1)
        self.picker.forget_stale()
        hashes = prefix_hashes(route.token_ids)
        route.prefill, route.decode = await self.picker.pick_waiting(
            route.deadline, hashes, wait_s=RESUME_WAIT_S
        )
        self._count_in_flight(route, +1)

    async def _take_back(self, route: _Route, error: grpc.aio.AioRpcError) -> None:
        """The decode stream broke (D died or is unreachable): D is passed over from now
        on, and the request, owned by D in the ledger, becomes QUEUED and this router's
        again, for the attempt loop to resume it on a new P and D (prompt + tokens sent,
        as after a preemption). D's fencing epoch is superseded, so a D that is in fact
        alive can no longer move the request; its blocks go back by its Abort (sent here)
        or, when it is dead, by the reaper once its lease expires. A request the ledger
        forgot (its Redis restarted empty, and D did not record it again, e.g. because D
        died meanwhile) is recorded anew. The Abort is awaited: D may be alive under a new
        epoch and be picked at once, and a late Abort would end the resumed request there."""
        rid, lost = route.request.request_id, route.decode
        log.warning(
            "%s: lost decode worker %s after %d tokens (%s: %s); migrating",
            rid,
            lost.worker_id,
            len(route.sent),
            error.code().name,
            error.details(),
        )
        self.picker.mark_unreachable(lost)
        abort = pb.AbortRequest(request_id=rid, reason="migrated: the router lost its stream")
        await self._abort_quietly(lost, abort)  # a dead process refuses it at once
        self._requeue(route, error)

    async def _take_back_from_prefill(
        self, route: _Route, error: grpc.aio.AioRpcError | Unavailable
    ) -> None:
        """Prefill failed before the first token: P died or refused the request under an
        epoch it has left, or D let the reservation go (D lost its lease on the blocks in
        a stall, or D died). P and D are told to drop it, and the request becomes QUEUED
        and this router's again, to be prefilled anew on the P and D picked next."""
        rid = route.request.request_id
        if isinstance(error, grpc.aio.AioRpcError):
            code, details = error.code().name, error.details() or ""
            push_refused = kv_push_status(error) is not None
        else:
            code, details, push_refused = "UNAVAILABLE", str(error), False
        log.warning(
            "%s: prefill on %s for %s failed (%s: %s); prefilling it again",
            rid,
            route.prefill.worker_id,
            route.decode.worker_id,
            code,
            details,
        )
        self.picker.forget_stale()  # P or D may be known under an epoch it has left
        if not push_refused:  # P itself failed, not D refusing P's push
            self.picker.mark_unreachable(route.prefill)
        abort = pb.AbortRequest(request_id=rid, reason="prefill failed: prefilling it again")
        await asyncio.gather(
            self._abort_quietly(route.prefill, abort), self._abort_quietly(route.decode, abort)
        )
        self._requeue(route, error)

    def _requeue(self, route: _Route, error: grpc.aio.AioRpcError | Unavailable) -> None:
        """The request, wherever P or D left it, becomes QUEUED and this router's again,
        for the attempt loop to prefill it anew (prompt + tokens sent). A request the
        ledger forgot (its Redis restarted empty, and D did not record it again) is
        recorded anew; one that ended meanwhile is not resumed (``error`` is raised)."""
        rid = route.request.request_id
        record = self.ledger.get_request(rid)
        if record is None:
            log.warning("%s: not in the ledger any more (Redis restarted?); recorded again", rid)
            self._create_in_ledger(route)
        elif record.state is RequestState.QUEUED and record.owner == self.membership.worker_id:
            route.owner_epoch = record.epoch  # handed back to this router already
        elif record.state in (
            RequestState.PREFILLING,
            RequestState.TRANSFERRING,
            RequestState.DECODING,
        ):
            self._take_over(route, record.state, record.epoch, error)
        else:
            raise error  # ended, or not P's or D's: nothing to resume
        self.metrics.migrations.labels(self.metrics.role).inc()

    def _take_over(
        self,
        route: _Route,
        state: RequestState,
        epoch: int,
        error: grpc.aio.AioRpcError | Unavailable,
    ) -> None:
        """``state`` (its holder's, P or D, at ``epoch``) -> QUEUED, owned by this router again."""
        rid = route.request.request_id
        try:
            self.ledger.transition(
                rid,
                RequestState.QUEUED,
                expected=state,
                epoch=epoch,
                new_owner=self.membership.worker_id,
                new_epoch=self.membership.epoch,
            )
            route.owner_epoch = self.membership.epoch
        except LedgerConflict:  # D moved it meanwhile: fine if it handed it back to us
            record = self.ledger.get_request(rid)
            if record is None or record.owner != self.membership.worker_id:
                raise error from None
            if record.state is not RequestState.QUEUED:
                raise error from None
            route.owner_epoch = record.epoch

    async def _abort_quietly(self, worker: WorkerInfo, abort: pb.AbortRequest) -> None:
        """Aborts on a prefill or decode worker that may well be dead."""
        channel = self._channels.get(worker.address)
        stub = (
            pb_grpc.PrefillWorkerStub(channel)
            if worker.role is WorkerRole.PREFILL
            else pb_grpc.DecodeWorkerStub(channel)
        )
        with contextlib.suppress(grpc.aio.AioRpcError):  # dead, as expected
            await stub.Abort(abort, timeout=ABORT_TIMEOUT_S)

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._cleanups.add(task)
        task.add_done_callback(self._cleanups.discard)

    async def _abandon(self, route: _Route, state: RequestState, reason: str) -> None:
        """Aborts the request on P and D (idempotent there) and ends it in the ledger."""
        rid = route.request.request_id
        log.info("%s %s: %s", rid, state.value.lower(), reason)
        abort = pb.AbortRequest(request_id=rid, reason=reason[:200])
        results = await asyncio.gather(
            self._prefiller(route).Abort(abort, timeout=ABORT_TIMEOUT_S),
            self._decoder(route).Abort(abort, timeout=ABORT_TIMEOUT_S),
            return_exceptions=True,
        )
        for result in results:
            if isinstance(result, BaseException):
                log.warning("%s: abort failed: %s", rid, result)
        self._end_in_ledger(rid, state, reason)

    def _is_forgotten(self, rid: str) -> bool:
        """Whether the ledger has no record of this (recorded) request: its Redis restarted
        empty. False when Redis cannot be asked (that error speaks for itself)."""
        try:
            return self.ledger.get_request(rid) is None
        except redis.RedisError:
            return False

    def _end_in_ledger(self, rid: str, state: RequestState, error: str) -> None:
        """Moves the request to ``state`` from wherever it is (its owner may be moving it)."""
        for _ in range(5):
            record = self.ledger.get_request(rid)
            if record is None or record.state.is_terminal:
                return
            try:
                self.ledger.transition(
                    rid, state, expected=record.state, epoch=record.epoch, error=error[:500]
                )
                return
            except LedgerConflict:
                continue
        log.warning("%s: could not record %s in the ledger", rid, state)

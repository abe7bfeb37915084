"""Requeueing a request whose prefill or decode worker failed it: the workers drop it, and
the ledger has it QUEUED and this router's again, for the service's attempt loop to resume
it on a new P and D (prompt + tokens already sent, as after a preemption).

One vocabulary for how a request leaves a component: on a decode worker its handle is
closed (``RequestHandle.close(CloseReason)``); on the router it is taken back (here, for
another attempt: ``RouterTransitions.take_back``) or ended (``GenerationService._end``).
Either way its workers are told to drop it (``abort_on``)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

import grpc  # type: ignore[import-untyped]  # no types-grpcio in the dev extra

from ledger.ledger import WorkerInfo, WorkerRole
from router.route import Route
from router.routing import WorkerPicker, prefix_hashes
from router.transitions import RouterTransitions
from serving.metrics import RouterMetrics
from serving.rpc import ChannelPool, Unavailable, kv_push_status
from tandem.v1 import kv_transfer_pb2 as kv_pb
from tandem.v1 import worker_pb2 as pb
from tandem.v1 import worker_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

ABORT_TIMEOUT_S = 2.0
# How long a request that lost its decode worker waits for a live one (the only one may be
# restarting: `tandem serve` restarts a dead worker within seconds); new requests wait the
# picker's wait_s.
RESUME_WAIT_S = 30.0
CHECKSUM_MISMATCH = kv_pb.KvPushStatus.Name(kv_pb.KV_PUSH_STATUS_CHECKSUM_MISMATCH)


def at_fault(route: Route, push_status: str | None) -> list[WorkerInfo]:
    """The workers a failed prefill's next attempt avoids, told by the KV push status the
    prefill worker's error carries (never by its message). None: the prefill worker
    itself failed (its engine wrote no layer within --transfer-stall-s, it died, or it
    refused the request). A checksum mismatch: both, since either end or the link between
    them corrupted the chunk. Any other: the decode worker's end (it took no chunk or sent
    no reply within --transfer-stall-s, its call broke, or it let the reservation go)."""
    if push_status is None:
        return [route.prefill]
    if push_status == CHECKSUM_MISMATCH:
        return [route.prefill, route.decode]
    return [route.decode]


class Migration:
    """The router's side of a migration; the service calls it between attempts."""

    def __init__(
        self,
        *,
        transitions: RouterTransitions,
        picker: WorkerPicker,
        channels: ChannelPool,
        metrics: RouterMetrics,
    ) -> None:
        self.transitions = transitions
        self.picker = picker
        self.channels = channels
        self.metrics = metrics

    async def repick(self, route: Route) -> None:
        """New P and D for a request its decode worker handed back (the ledger has it
        QUEUED and owned by this router again); waits up to RESUME_WAIT_S for them."""
        self.picker.count_in_flight(route.workers, -1)
        self.picker.forget_stale()
        lora = route.request.lora
        hashes = prefix_hashes(route.token_ids, lora=lora)
        route.prefill, route.decode = await self.picker.pick_waiting(
            route.deadline, hashes, wait_s=RESUME_WAIT_S, avoid=route.avoid, lora=lora
        )
        self.picker.count_in_flight(route.workers, +1)

    async def requeue_after_lost_decode(self, route: Route, error: grpc.aio.AioRpcError) -> None:
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
            len(route.output_tokens_sent),
            error.code().name,
            error.details(),
        )
        self.picker.mark_unreachable(lost)
        # A dead process refuses it at once.
        await abort_on(self.channels, [lost], rid, "migrated: the router lost its stream")
        self._requeue(route, error)

    async def requeue_after_lost_reservation(
        self, route: Route, error: grpc.aio.AioRpcError
    ) -> None:
        """D refused the Decode call: it no longer holds the reservation that P filled
        (it restarted or registered again since the Reserve, or let the reservation go).
        D is alive, so it is not marked unreachable, only avoided for this request's next
        attempts; P's blocks were freed when its push ended. The request becomes QUEUED
        and this router's again, to be prefilled anew."""
        rid = route.request.request_id
        log.warning(
            "%s: %s no longer holds its reservation (%s: %s); prefilling it again",
            rid,
            route.decode.worker_id,
            error.code().name,
            error.details(),
        )
        self.picker.forget_stale()  # D may be known under an epoch it has left
        route.avoid.add(route.decode.worker_id)
        reason = "reservation lost: prefilling it again"
        await abort_on(self.channels, [route.decode], rid, reason)  # what D still has of it
        self._requeue(route, error)

    async def requeue_after_failed_prefill(
        self, route: Route, error: grpc.aio.AioRpcError | Unavailable
    ) -> None:
        """Prefill failed before the first token: P died, its engine stalled or it refused
        the request (under an epoch it has left, or an adapter it no longer holds as the
        router saw it); or the KV push failed (D stopped taking
        it, a checksum differed, D let the reservation go). P and D are told to drop it
        (D's engine frees the blocks before it reserves any again), and the request
        becomes QUEUED and this router's again, to be prefilled anew on the P and D
        picked next: not the side ``at_fault`` where another worker of that role is
        live. Only P failing itself marks it unreachable: a failed push tells which end
        failed this request, not that the worker is gone (D's own calls tell that)."""
        rid = route.request.request_id
        if isinstance(error, grpc.aio.AioRpcError):
            code, details = error.code().name, error.details() or ""
            push_status = kv_push_status(error)
        else:
            code, details, push_status = "UNAVAILABLE", str(error), None
        avoided = at_fault(route, push_status)
        log.warning(
            "%s: prefill on %s for %s failed (%s: %s); prefilling it again, avoiding %s",
            rid,
            route.prefill.worker_id,
            route.decode.worker_id,
            code,
            details,
            ", ".join(w.worker_id for w in avoided),
        )
        self.picker.forget_stale()  # P or D may be known under an epoch it has left
        if push_status is None and code != "FAILED_PRECONDITION":
            # P itself failed, not P's push into D, nor P refusing this request alone (it
            # does not hold the request's adapter as its heartbeat said: a race)
            self.picker.mark_unreachable(route.prefill)
        route.avoid.update(w.worker_id for w in avoided)
        reason = "prefill failed: prefilling it again"
        await abort_on(self.channels, route.workers, rid, reason)
        self._requeue(route, error)

    def _requeue(self, route: Route, error: grpc.aio.AioRpcError | Unavailable) -> None:
        """QUEUED and this router's again, for the next attempt; ``error`` is raised if it
        ended meanwhile."""
        self.transitions.take_back(route, error)
        self.metrics.migrations.labels(self.metrics.role).inc()


async def abort_on(
    channels: ChannelPool, workers: Iterable[WorkerInfo], rid: str, reason: str
) -> None:
    """Tells each of ``workers`` (prefill or decode; a co-located one once) to drop the
    request, all at once. Aborts are idempotent there; a worker that does not answer
    (dead, as may be expected) is logged, not raised, whatever the error."""
    abort = pb.AbortRequest(request_id=rid, reason=reason[:200])
    unique = list({w.worker_id: w for w in workers}.values())
    calls = []
    for worker in unique:
        channel = channels.get(worker.address)
        stub = (
            pb_grpc.PrefillWorkerStub(channel)
            if worker.role is WorkerRole.PREFILL
            else pb_grpc.DecodeWorkerStub(channel)
        )
        calls.append(stub.Abort(abort, timeout=ABORT_TIMEOUT_S))
    results = await asyncio.gather(*calls, return_exceptions=True)
    for worker, result in zip(unique, results, strict=True):
        if isinstance(result, BaseException):
            log.warning("%s: abort on %s failed: %s", rid, worker.worker_id, result)

"""A failed prefill is retried away from the side at fault (router/migration.py), on a real
Redis ledger: the KV push status the prefill worker's error carries (trailing metadata,
never the message) says which side; that worker is avoided for the request's next
attempts, where another of its role is live, and only a prefill worker failing itself is
marked unreachable. Avoiding is a preference: a lone worker is picked again. A request
its client is told to retry is ended first, so that a retry may take its id again."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
import redis

from ledger.ledger import Ledger, LedgerConflict, RequestState, WorkerInfo, WorkerRole
from ledger.membership import Membership, Timing
from router.migration import Migration
from router.route import Route
from router.routing import WorkerPicker, prefix_hashes
from router.service import GenerationService
from router.transitions import RouterTransitions
from router.validation import ModelInfo, RequestValidator, ValidRequest
from serving.lora_setup import lora_figure
from serving.metrics import RouterMetrics
from serving.rpc import ChannelPool, Unavailable
from tandem.v1 import generation_pb2 as gen
from tandem.v1 import worker_pb2 as pb
from tandem_client.wire import KV_PUSH_STATUS_KEY

REFUSED = "127.0.0.1:1"  # nothing listens: the Aborts the router sends fail at once


def join(ledger: Ledger, worker_id: str, role: WorkerRole) -> None:
    epoch = ledger.register_worker(worker_id, role=role, address=REFUSED, capacity=1, ttl_ms=60_000)
    stats = {"model": "m", "draining": 0, "draft_fingerprint": "", "prefills_in_place": 0}
    ledger.heartbeat(worker_id, epoch=epoch, ttl_ms=60_000, load=0.1, stats=stats)


def two_pairs(ledger: Ledger) -> dict[str, WorkerInfo]:
    for i in range(2):
        join(ledger, f"p{i}", WorkerRole.PREFILL)
        join(ledger, f"d{i}", WorkerRole.DECODE)
    return {w.worker_id: w for w in ledger.list_workers()}


def ids(pair: tuple[WorkerInfo, ...]) -> tuple[str, ...]:
    return tuple(w.worker_id for w in pair)


def test_a_retry_avoids_the_workers_at_fault_unless_they_are_the_only_ones(
    ledger: Ledger,
) -> None:
    workers = two_pairs(ledger)
    picker = WorkerPicker(ledger, "m", refresh_s=0.0)
    for _ in range(4):  # equal scores take turns: every turn avoids them
        assert picker.pick(avoid={"d0"})[1].worker_id == "d1"
        assert ids(picker.pick(avoid={"p0", "d0"})) == ("p1", "d1")
    hashes = prefix_hashes(list(range(64)))
    picker.remember([workers["p0"], workers["d0"]], hashes)
    assert ids(picker.pick(hashes)) == ("p0", "d0")  # warm
    assert ids(picker.pick(hashes, avoid={"d0"})) == ("p0", "d1")  # warm, but at fault
    assert picker.least_loaded(picker.decoders_for(workers["p0"]), {"d0"}).worker_id == "d1"
    # The only live decode worker is picked again, avoided or not.
    picker.mark_unreachable(workers["d1"])
    assert ids(picker.pick(avoid={"p0", "d0"})) == ("p1", "d0")


def prefill_error(push_status: str | None) -> grpc.aio.AioRpcError:
    """The error a router's Prefill call gets: UNAVAILABLE, with the push status, if any,
    in the trailing metadata (serving.rpc, from the prefill worker's exception)."""
    trailing = [(KV_PUSH_STATUS_KEY, push_status)] if push_status else []
    return grpc.aio.AioRpcError(
        grpc.StatusCode.UNAVAILABLE,
        grpc.aio.Metadata(),
        grpc.aio.Metadata(*trailing),
        details="prefill worker: request r1: stalled: ...",
    )


@pytest.mark.parametrize(
    ("error", "avoided", "unreachable", "next_pair"),
    [
        # The prefill worker's engine wrote no layer in time (no push status): its fault.
        (prefill_error(None), {"p0"}, {"p0"}, ("p1", None)),
        # The router could not reach it at all.
        (Unavailable("prefill worker p0: not reachable"), {"p0"}, {"p0"}, ("p1", None)),
        # The decode worker took no chunk (or sent no reply) in time: its end.
        (prefill_error("KV_PUSH_STATUS_INCOMPLETE"), {"d0"}, set(), (None, "d1")),
        # A chunk corrupted on either end or between them: another pair.
        (prefill_error("KV_PUSH_STATUS_CHECKSUM_MISMATCH"), {"p0", "d0"}, set(), ("p1", "d1")),
        # The decode worker restarted or let the reservation go.
        (prefill_error("KV_PUSH_STATUS_STALE_EPOCH"), {"d0"}, set(), (None, "d1")),
    ],
    ids=["engine-stalled", "prefill-unreachable", "receiver-stalled", "checksum", "stale-epoch"],
)
async def test_a_failed_prefill_is_requeued_away_from_the_side_at_fault(
    ledger: Ledger,
    error: grpc.aio.AioRpcError | Unavailable,
    avoided: set[str],
    unreachable: set[str],
    next_pair: tuple[str | None, str | None],
) -> None:
    workers = two_pairs(ledger)
    membership = Membership(
        ledger, "router-0", role=WorkerRole.ROUTER, address=REFUSED, capacity=0, timing=Timing()
    )
    membership.register()
    picker = WorkerPicker(ledger, "m", refresh_s=0.0)
    channels = ChannelPool()
    transitions = RouterTransitions(membership, "m")
    migration = Migration(
        transitions=transitions, picker=picker, channels=channels, metrics=RouterMetrics()
    )
    valid = ValidRequest("r1", [1, 2, 3], gen.SamplingParams(), max_tokens=4)
    p0, d0 = workers["p0"], workers["d0"]
    route = Route(valid, p0, d0, time.monotonic() + 30)
    transitions.record(route)
    transitions.hand_to_prefill(route)  # as before the Prefill call
    try:
        await migration.requeue_after_failed_prefill(route, error)
        assert route.avoid == avoided
        marked = set(workers)
        marked -= {w.worker_id for role in WorkerRole for w in picker.workers(role)}
        assert marked == unreachable
        record = ledger.get_request("r1")
        assert record is not None and record.state is RequestState.QUEUED
        assert record.owner == "router-0"
        for _ in range(4):  # every turn
            await migration.repick(route)
            for want, got in zip(next_pair, ids((route.prefill, route.decode)), strict=True):
                assert want is None or got == want
    finally:
        await channels.close()


class _FailingReserve(GenerationService):
    """A router whose every Reserve fails with ``error``, after the request was recorded."""

    def __init__(self, error: Exception, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.error = error

    async def _reserve(self, route: Route) -> Any:
        raise self.error


def _failing_router(ledger: Ledger, error: Exception) -> _FailingReserve:
    """A registered router over two pairs of workers (at an address that refuses)."""
    two_pairs(ledger)
    membership = Membership(
        ledger, "router-0", role=WorkerRole.ROUTER, address=REFUSED, capacity=0, timing=Timing()
    )
    membership.register()
    return _FailingReserve(
        error,
        validator=RequestValidator(ModelInfo("m", vocab_size=64, max_model_len=64), None),
        picker=WorkerPicker(ledger, "m", refresh_s=0.0),
        membership=membership,
    )


class _Context:
    def time_remaining(self) -> float:
        return 30.0


@pytest.mark.parametrize(
    ("error", "retryable"),
    [(Unavailable("decode worker d0: gone"), True), (ValueError("sampling: no"), False)],
    ids=["unavailable", "invalid"],
)
async def test_a_request_told_to_retry_is_ended_first_and_its_id_taken_again(
    ledger: Ledger, error: Exception, retryable: bool
) -> None:
    """The router ends a failed request (Aborts sent, FAILED in the ledger) before its
    client hears of it: a retry under the same id, sent at once, finds no live record of
    the first attempt, and no late cleanup of it can fail the retry. After UNAVAILABLE the
    id is taken again; after any other error a retry is refused as a duplicate."""
    router = _failing_router(ledger, error)
    request = gen.GenerateRequest(
        request_id="mine",
        token_ids=gen.TokenIds(ids=[1, 2, 3]),
        sampling=gen.SamplingParams(max_tokens=4),
    )
    try:
        with pytest.raises(type(error)):
            async for _ in router.Generate(request, _Context()):
                pass
        record = ledger.get_request("mine")  # at once: no cleanup left to run
        assert record is not None and record.state is RequestState.FAILED
        assert record.retryable is retryable
        assert record.error == f"{type(error).__name__}: {error}"
        retried: type[Exception] = type(error) if retryable else LedgerConflict
        with pytest.raises(retried):
            async for _ in router.Generate(request, _Context()):
                pass
        assert router.num_in_flight == 0 and not router._cleanups
    finally:
        await router.close()


async def test_a_ledger_out_of_reach_leaves_the_clients_error_as_it_was(
    ledger: Ledger, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ending the request needs Redis; when Redis cannot be reached, the client still gets
    the request's own error, and the ending is tried again in a task of its own."""
    router = _failing_router(ledger, Unavailable("decode worker d0: gone"))
    request = gen.GenerateRequest(token_ids=gen.TokenIds(ids=[1, 2, 3]))

    def unreachable(request_id: str) -> None:
        raise redis.ConnectionError("Redis is out of reach")

    monkeypatch.setattr(ledger, "get_request", unreachable)
    try:
        with pytest.raises(Unavailable, match=r"^decode worker d0: gone$"):
            async for _ in router.Generate(request, _Context()):
                pass
        assert len(router._cleanups) == 1  # the ending, tried again
        await asyncio.gather(*router._cleanups, return_exceptions=True)
    finally:
        await router.close()


class _PickyDecoders(GenerationService):
    """A router whose decode workers answer Reserve from ``refusing``: FAILED_PRECONDITION
    (they do not serve the request as their heartbeat said), the others a reply."""

    def __init__(self, refusing: set[str], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.refusing = refusing
        self.asked: list[str] = []

    def _decoder(self, route: Route) -> Any:
        worker_id = route.decode.worker_id

        async def reserve(request: pb.ReserveRequest, timeout: float) -> pb.ReserveReply:
            self.asked.append(worker_id)
            assert (request.lora, request.lora_digest) == ("x", "01")
            if worker_id in self.refusing:
                raise grpc.aio.AioRpcError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    grpc.aio.Metadata(),
                    grpc.aio.Metadata(),
                    details="lora: this worker has no adapter 'x'",
                )
            return pb.ReserveReply(block_ids=[1], epoch=route.decode.epoch)

        return SimpleNamespace(Reserve=reserve)


@pytest.mark.parametrize("refusing", [{"d0"}, {"d0", "d1"}], ids=["one", "all"])
async def test_a_decode_worker_that_refuses_the_adapter_is_passed_over(
    ledger: Ledger, refusing: set[str]
) -> None:
    """A decode worker whose heartbeat listed the request's adapter but that refuses it
    (FAILED_PRECONDITION: unloaded since, a race) is passed over for another that holds
    it; when every one refuses, the request fails with that status."""
    for worker_id, role in (("p0", WorkerRole.PREFILL), ("d0", WorkerRole.DECODE),
                            ("d1", WorkerRole.DECODE)):  # fmt: skip
        epoch = ledger.register_worker(
            worker_id, role=role, address=REFUSED, capacity=1, ttl_ms=60_000
        )
        stats = {"model": "m", "draining": 0, "draft_fingerprint": "", **lora_figure({"x": "01"})}
        load = 0.1 if worker_id == "d0" else 0.5  # d0 first
        ledger.heartbeat(worker_id, epoch=epoch, ttl_ms=60_000, load=load, stats=stats)
    membership = Membership(
        ledger, "router-0", role=WorkerRole.ROUTER, address=REFUSED, capacity=0, timing=Timing()
    )
    membership.register()
    picker = WorkerPicker(ledger, "m", refresh_s=0.0)
    router = _PickyDecoders(
        refusing,
        validator=RequestValidator(ModelInfo("m", vocab_size=64, max_model_len=64), None),
        picker=picker,
        membership=membership,
    )
    valid = ValidRequest("r1", [1, 2, 3], gen.SamplingParams(), max_tokens=4, lora="x")
    route = Route(valid, *picker.pick(lora="x"), time.monotonic() + 30)
    assert route.decode.worker_id == "d0" and route.lora_digest == "01"
    router.transitions.record(route)
    try:
        if refusing == {"d0"}:
            reply = await router._reserve(route)
            assert route.decode.worker_id == "d1" and list(reply.block_ids) == [1]
            assert router.asked == ["d0", "d1"]
        else:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await router._reserve(route)
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert router.asked == ["d0", "d1"]
    finally:
        await router.close()

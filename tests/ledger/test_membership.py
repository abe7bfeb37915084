"""Membership on a real Redis: heartbeats keep a registration and its leases alive; when
Redis forgets everything (restarted empty: a new generation), the next heartbeat registers
again with a new epoch and records again what the worker says it decodes, dropping the
rest; a stall past the registration (same generation) drops all that was held."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from ledger import scripts as lua
from ledger.ledger import KvPool, Ledger, RequestState, WorkerRole
from ledger.membership import HeldRequest, Membership, Timing
from ledger.redis_server import RedisServer, free_port


async def test_registers_again_with_a_new_epoch_when_redis_forgets_it(ledger: Ledger) -> None:
    lost: list[str] = []
    again: list[int] = []
    # Heartbeats every 200 ms (registration TTL 600 ms), lease 1.2 s. With 50 ms beats
    # (TTL 150 ms) two full-suite CI runs lost the registration within the first 0.4 s:
    # a heartbeat over 100 ms late (not reproduced alone or with the cluster tests).
    membership = _decode_membership(
        ledger, lost, heartbeat_ms=200, lease_ms=1200, on_registered=again.append
    )
    first = membership.register()
    ledger.create_request("r1", owner="router", epoch=1)
    membership.claim("r1", [1, 2], has_draft=False)
    membership.start()
    try:
        await asyncio.sleep(1.3)  # past the lease: renewals kept it
        assert lost == [] and again == [first] and membership.is_holding("r1")

        for key in ledger.client.scan_iter(match=f"{ledger.ns}:*"):  # an empty restart
            ledger.client.delete(key)
        for _ in range(100):
            if len(again) > 1:
                break
            await asyncio.sleep(0.02)
        assert again == [first, membership.epoch] and membership.epoch > first
        assert lost == ["r1"] and not membership.is_holding("r1")
        assert [(w.worker_id, w.epoch) for w in ledger.list_workers()] == [("d0", again[1])]
    finally:
        await membership.stop()
    assert ledger.list_workers() == []


def _decode_membership(
    ledger: Ledger,
    lost: list[str],
    *,
    heartbeat_ms: int = 50,
    lease_ms: int = 500,
    rebuild_from: Callable[[], Awaitable[Sequence[HeldRequest]]] | None = None,
    on_registered: Callable[[int], None] | None = None,
) -> Membership:
    """A decode worker "d0" heartbeating every 50 ms (default), serving model "m"; its
    component records the leases lost in ``lost``."""
    component = _Component(lost, rebuild_from, on_registered)
    return Membership(
        ledger,
        "d0",
        role=WorkerRole.DECODE,
        address="127.0.0.1:1",
        capacity=8,
        timing=Timing(heartbeat_ms=heartbeat_ms, lease_ms=lease_ms),
        component=component,
    )


@dataclass
class _Component:
    """The component membership talks to (ledger.membership.Component), as the test says."""

    lost: list[str]
    rebuild_from: Callable[[], Awaitable[Sequence[HeldRequest]]] | None
    registered: Callable[[int], None] | None

    def load(self) -> tuple[float, Mapping[str, str | int | float]]:
        return 0.0, {"model": "m"}

    def on_lease_lost(self, request_id: str) -> None:
        self.lost.append(request_id)

    def on_registered(self, epoch: int) -> None:
        if self.registered is not None:
            self.registered(epoch)

    async def held_requests(self) -> Sequence[HeldRequest]:
        return await self.rebuild_from() if self.rebuild_from is not None else ()


async def _wait_for(condition: Callable[[], bool], timeout_s: float = 2.0) -> None:
    for _ in range(int(timeout_s / 0.02)):
        if condition():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not met in time")


async def test_rebuilds_decoding_requests_when_redis_restarts_empty(ledger: Ledger) -> None:
    """A new generation: what the worker says it is decoding is recorded again, DECODING
    and owned by it at its new epoch, with its blocks under a live lease; the rest of what
    it held is dropped. The record then ends as any other."""
    lost: list[str] = []
    asked: list[int] = []

    async def decoding() -> Sequence[HeldRequest]:
        asked.append(membership.epoch)
        fields = {"model": "m", "num_prompt_tokens": 7, "router": "router-0"}
        return [HeldRequest("r1", [1, 2, 3, 9], fields)]  # the table grew since the claim

    membership = _decode_membership(ledger, lost, rebuild_from=decoding)
    first = membership.register()
    generation = membership.generation
    for rid in ("r1", "r2"):  # r2: reserved, its KV still on the way
        ledger.create_request(rid, owner="router-0", epoch=1)
        membership.claim(rid, [4, 5] if rid == "r2" else [1, 2, 3], has_draft=True)
    membership.start()
    try:
        for key in ledger.client.scan_iter(match=f"{ledger.ns}:*"):  # an empty restart
            ledger.client.delete(key)
        membership.resize("r1", [1, 2, 3, 9, 10])  # refused: kept for after the rebuild
        await _wait_for(lambda: bool(asked))
        assert asked == [membership.epoch] and membership.epoch > first
        assert membership.generation not in ("", generation)
        assert lost == ["r2"]
        assert membership.is_holding("r1") and not membership.is_holding("r2")

        record = ledger.get_request("r1")
        assert record is not None
        assert (record.state, record.owner, record.epoch) == (
            RequestState.DECODING,
            "d0",
            membership.epoch,
        )
        assert record.fields["num_prompt_tokens"] == "7" and "restored_ms" in record.fields
        assert ledger.get_request("r2") is None
        [holding] = ledger.holdings()
        assert (holding.request_id, holding.worker_id, holding.epoch) == (
            "r1",
            "d0",
            membership.epoch,
        )
        assert holding.blocks == {KvPool.TARGET: {1, 2, 3, 9, 10}, KvPool.DRAFT: {1, 2, 3, 9, 10}}
        await asyncio.sleep(0.7)  # past the lease: the heartbeat renews the rebuilt one
        assert ledger.holdings()[0].lease_ttl_ms > 0 and lost == ["r2"]

        membership.free("r1")  # finished: the new epoch ends it
        ledger.transition(
            "r1", RequestState.FINISHED, expected=RequestState.DECODING, epoch=membership.epoch
        )
        assert ledger.holdings() == [] and len(asked) == 1
    finally:
        await membership.stop()


async def test_rebuilds_decoding_requests_when_redis_is_restored_from_a_snapshot(
    tmp_path: Path,
) -> None:
    """Redis comes back from a snapshot taken before the worker's last heartbeats: the same
    generation, but the worker's clock in it is behind what it read. A new generation
    begins and the worker rebuilds as after an empty restart: a new epoch, and what it
    decodes recorded again, replacing the records the snapshot brought back (an older
    state, an older table), nothing dropped."""
    with RedisServer(port=free_port()) as server:  # TCP: restarted where the client looks
        ledger = Ledger(server.client(decode_responses=True), namespace="snap")
        lost: list[str] = []
        tables = {"r1": [1, 2], "r2": [5]}

        async def decoding() -> Sequence[HeldRequest]:
            return [HeldRequest(rid, table, {"model": "m"}) for rid, table in tables.items()]

        membership = _decode_membership(ledger, lost, rebuild_from=decoding)
        first = membership.register()
        _decoding(ledger, "r1", owner_epoch=first)
        ledger.create_request("r2", owner="router-0", epoch=1)  # its prefill is under way
        for rid, table in tables.items():
            membership.claim(rid, table, has_draft=False)
        snapshot = server.save(tmp_path / "dump.rdb")
        membership.start()
        try:
            _hand_to_d0(ledger, "r2", owner_epoch=first)
            tables["r1"] = [1, 2, 3]
            membership.resize("r1", tables["r1"])
            await asyncio.sleep(0.2)  # heartbeats: the worker's clock moves on
            assert _target_blocks(ledger) == {"r1": {1, 2, 3}, "r2": {5}}
            generation = membership.generation
            server.crash()
            server.start(rdb=snapshot)
            await _wait_for(lambda: membership.epoch > first, timeout_s=5)

            assert membership.generation.id != generation.id and lost == []
            for rid in tables:
                record = ledger.get_request(rid)
                assert record is not None, rid
                assert (record.state, record.owner, record.epoch) == (
                    RequestState.DECODING,
                    "d0",
                    membership.epoch,
                )
            assert _target_blocks(ledger) == {"r1": {1, 2, 3}, "r2": {5}}
            assert {h.epoch for h in ledger.holdings()} == {membership.epoch}
        finally:
            await membership.stop()
            ledger.client.close()


async def test_grown_tables_are_recorded_after_the_step_one_script_each(ledger: Ledger) -> None:
    """``resize`` writes nothing on the caller's path; once the event loop turns, one
    script per request whose table changed, however often it was noted. A request the
    ledger has moved on (the router took it back) is refused and dropped."""
    lost: list[str] = []
    membership = _decode_membership(ledger, lost)
    membership.register()
    for rid, block_ids in (("r1", [1, 2]), ("r2", [5])):
        _decoding(ledger, rid, owner_epoch=membership.epoch)
        membership.claim(rid, block_ids, has_draft=True)
    ledger.client.script_load(lua.RESIZE_BLOCKS)  # counted below: no NOSCRIPT retry
    calls = _script_calls(ledger)
    membership.resize("r1", [1, 2, 3])
    membership.resize("r2", [5])  # unchanged
    membership.resize("r1", [1, 2, 3, 4])  # grew again within the same step
    assert _script_calls(ledger) == calls  # nothing on the caller's path
    await asyncio.sleep(0)
    assert _script_calls(ledger) == calls + 1
    assert _target_blocks(ledger) == {"r1": {1, 2, 3, 4}, "r2": {5}}
    assert {h.request_id: h.blocks[KvPool.DRAFT] for h in ledger.holdings()} == {
        "r1": {1, 2, 3, 4},
        "r2": {5},
    }
    assert ledger.audit({"d0": {1, 2, 3, 4, 5}}) == []

    calls = _script_calls(ledger)
    membership.resize("r2", [5, 6])
    membership.resize("r1", [2, 3, 4])  # shrunk
    await asyncio.sleep(0)
    assert _script_calls(ledger) == calls + 2
    assert _target_blocks(ledger) == {"r1": {2, 3, 4}, "r2": {5, 6}}

    ledger.transition(  # the router took r1 back (it lost d0's stream)
        "r1",
        RequestState.QUEUED,
        expected=RequestState.DECODING,
        epoch=membership.epoch,
        new_owner="router-0",
        new_epoch=1,
    )
    membership.resize("r1", [2, 3, 4, 7])
    await asyncio.sleep(0)
    assert lost == ["r1"] and not membership.is_holding("r1") and membership.is_holding("r2")
    assert _target_blocks(ledger) == {"r2": {5, 6}}  # d0's holding of r1 released
    membership.free("r2")
    assert ledger.holdings() == [] and ledger.audit({"d0": set()}) == []


def _decoding(ledger: Ledger, request_id: str, *, owner_epoch: int) -> None:
    """A request router-0 (at epoch 1) recorded and handed to decode worker d0."""
    ledger.create_request(request_id, owner="router-0", epoch=1)
    _hand_to_d0(ledger, request_id, owner_epoch=owner_epoch)


def _hand_to_d0(ledger: Ledger, request_id: str, *, owner_epoch: int) -> None:
    """QUEUED -> DECODING, owned by decode worker d0 at ``owner_epoch``."""
    path = [RequestState.QUEUED, RequestState.PREFILLING, RequestState.TRANSFERRING]
    for expected, to in itertools.pairwise([*path, RequestState.DECODING]):
        epoch = 1 if expected is RequestState.QUEUED else owner_epoch
        ledger.transition(
            request_id, to, expected=expected, epoch=epoch, new_owner="d0", new_epoch=owner_epoch
        )


def _script_calls(ledger: Ledger) -> int:
    """EVALSHA calls the server has run: the ledger's scripts, reads included."""
    return int(ledger.client.info("commandstats")["cmdstat_evalsha"]["calls"])


def _target_blocks(ledger: Ledger) -> dict[str, frozenset[int]]:
    return {h.request_id: h.blocks[KvPool.TARGET] for h in ledger.holdings()}


async def test_a_stall_past_the_registration_drops_what_was_held(ledger: Ledger) -> None:
    """The same generation but no registration: the process stalled, its requests may
    have moved on, so nothing is rebuilt and everything held is dropped."""
    lost: list[str] = []
    asked: list[int] = []

    async def decoding() -> Sequence[HeldRequest]:
        asked.append(membership.epoch)
        return [HeldRequest("r1", [1, 2])]

    membership = _decode_membership(ledger, lost, rebuild_from=decoding)
    first = membership.register()
    ledger.create_request("r1", owner="router-0", epoch=1)
    membership.claim("r1", [1, 2], has_draft=False)
    membership.start()
    try:
        ledger.client.delete(f"{ledger.ns}:worker:d0")  # expired, as after a long stall
        await _wait_for(lambda: bool(lost))
        assert lost == ["r1"] and asked == [] and membership.epoch > first
        record = ledger.get_request("r1")
        assert record is not None and record.state is RequestState.QUEUED  # untouched
    finally:
        await membership.stop()

"""The Redis ledger against a real redis-server: states, fencing, leases, workers."""

from __future__ import annotations

import itertools
import random
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from ledger.ledger import (
    ALLOWED_TRANSITIONS,
    Generation,
    Ledger,
    LedgerConflict,
    Pool,
    RequestRecord,
    RequestState,
    WorkerRole,
)
from ledger.redis_server import RedisServer, free_port

S = RequestState
LEASE_MS = 60_000


@dataclass(frozen=True)
class Epochs:
    router: int
    prefill: int
    decode: int


def _record(ledger: Ledger, request_id: str) -> RequestRecord:
    record = ledger.get_request(request_id)
    assert record is not None, f"no record of {request_id}"
    return record


def _register(ledger: Ledger, ttl_ms: int = 60_000) -> Epochs:
    return Epochs(
        router=ledger.register_worker(
            "router-0", role=WorkerRole.ROUTER, address="127.0.0.1:1", capacity=0, ttl_ms=ttl_ms
        ),
        prefill=ledger.register_worker(
            "prefill-0", role=WorkerRole.PREFILL, address="127.0.0.1:2", capacity=64, ttl_ms=ttl_ms
        ),
        decode=ledger.register_worker(
            "decode-0", role=WorkerRole.DECODE, address="127.0.0.1:3", capacity=128, ttl_ms=ttl_ms
        ),
    )


def _drive(ledger: Ledger, request_id: str, state: RequestState, e: Epochs) -> None:
    """Creates a request and takes it to ``state`` along a legal path."""
    ledger.create_request(request_id, owner="router-0", epoch=e.router)
    if state in (S.FAILED, S.CANCELLED):
        ledger.transition(request_id, state, expected=S.QUEUED, epoch=e.router)
        return
    path = [S.QUEUED, S.PREFILLING, S.TRANSFERRING, S.DECODING, S.FINISHED]
    for prev, to in itertools.pairwise(path[: path.index(state) + 1]):
        _step(ledger, request_id, prev, to, e)


def _step(ledger: Ledger, rid: str, prev: RequestState, to: RequestState, e: Epochs) -> None:
    if prev is S.QUEUED:  # the router hands the request to the prefill worker
        ledger.transition(
            rid, to, expected=prev, epoch=e.router, new_owner="prefill-0", new_epoch=e.prefill
        )
    elif prev is S.TRANSFERRING:  # the prefill worker hands it to the decode worker
        ledger.transition(
            rid, to, expected=prev, epoch=e.prefill, new_owner="decode-0", new_epoch=e.decode
        )
    else:
        owner = e.prefill if prev is S.PREFILLING else e.decode
        ledger.transition(rid, to, expected=prev, epoch=owner)


def test_happy_path_through_every_state(ledger: Ledger) -> None:
    e = _register(ledger)
    created = ledger.create_request(
        "r1", owner="router-0", epoch=e.router, fields={"model": "smollm2", "num_prompt_tokens": 7}
    )
    assert (created.state, created.owner, created.epoch, created.version) == (
        S.QUEUED,
        "router-0",
        e.router,
        0,
    )
    assert created.fields == {"model": "smollm2", "num_prompt_tokens": "7"}
    with pytest.raises(LedgerConflict, match="expected no record"):
        ledger.create_request("r1", owner="router-0", epoch=e.router)

    rec = ledger.transition(
        "r1",
        S.PREFILLING,
        expected=S.QUEUED,
        epoch=e.router,
        new_owner="prefill-0",
        new_epoch=e.prefill,
    )
    assert (rec.state, rec.owner, rec.epoch) == (S.PREFILLING, "prefill-0", e.prefill)
    rec = ledger.transition("r1", S.TRANSFERRING, expected=S.PREFILLING, epoch=e.prefill)
    rec = ledger.transition(
        "r1",
        S.DECODING,
        expected=S.TRANSFERRING,
        epoch=e.prefill,
        new_owner="decode-0",
        new_epoch=e.decode,
    )
    assert (rec.state, rec.owner) == (S.DECODING, "decode-0")
    # Preemption hand-back to the router, then a second round.
    ledger.transition(
        "r1",
        S.QUEUED,
        expected=S.DECODING,
        epoch=e.decode,
        new_owner="router-0",
        new_epoch=e.router,
    )
    for prev, to in [
        (S.QUEUED, S.PREFILLING),
        (S.PREFILLING, S.TRANSFERRING),
        (S.TRANSFERRING, S.DECODING),
    ]:
        _step(ledger, "r1", prev, to, e)
    rec = ledger.transition("r1", S.FINISHED, expected=S.DECODING, epoch=e.decode)
    assert rec.state is S.FINISHED and rec.version == 8
    assert rec.created_ms <= rec.updated_ms
    assert ledger.get_request("r1") == rec
    assert ledger.get_request("nope") is None
    # Ended records keep a short TTL; live ones the long one.
    assert 0 < ledger.client.pttl(ledger._record_key("r1")) <= 5000
    live = ledger.create_request("r2", owner="router-0", epoch=e.router)
    assert ledger.client.pttl(ledger._record_key(live.request_id)) > 5000


def test_every_illegal_transition_is_refused(ledger: Ledger) -> None:
    e = _register(ledger)
    for state in S:
        rid = f"in-{state.lower()}"
        _drive(ledger, rid, state, e)
        epoch = _record(ledger, rid).epoch
        for to in S:
            if to not in ALLOWED_TRANSITIONS[state]:
                with pytest.raises(LedgerConflict, match=f"illegal transition {state} -> {to}"):
                    ledger.transition(rid, to, expected=state, epoch=epoch)
        # Legal edges from other states are refused by the script: wrong actual state.
        for expected, targets in ALLOWED_TRANSITIONS.items():
            if expected is state:
                continue
            for to in targets:
                with pytest.raises(
                    LedgerConflict, match=f"expected state {expected}, found {state}"
                ):
                    ledger.transition(rid, to, expected=expected, epoch=epoch)
        assert _record(ledger, rid).state is state
    with pytest.raises(LedgerConflict, match="found no record"):
        ledger.transition("missing", S.PREFILLING, expected=S.QUEUED, epoch=e.router)


def test_stale_epoch_is_refused(ledger: Ledger) -> None:
    e = _register(ledger)
    _drive(ledger, "r1", S.PREFILLING, e)
    # The router handed the request over: its epoch no longer moves it.
    with pytest.raises(
        LedgerConflict, match=f"expected owner prefill-0 at epoch {e.prefill}, got epoch {e.router}"
    ):
        ledger.transition("r1", S.TRANSFERRING, expected=S.PREFILLING, epoch=e.router)
    # The prefill worker restarts (new registration, new epoch): neither instance can
    # move the request the old one owned; the router must re-route it.
    new_prefill = ledger.register_worker(
        "prefill-0", role=WorkerRole.PREFILL, address="127.0.0.1:2", capacity=64, ttl_ms=60_000
    )
    assert new_prefill > e.prefill > e.router
    with pytest.raises(LedgerConflict, match="stale epoch"):
        ledger.transition("r1", S.TRANSFERRING, expected=S.PREFILLING, epoch=new_prefill)
    with pytest.raises(
        LedgerConflict, match=f"stale epoch: expected {new_prefill}, got {e.prefill}"
    ):
        ledger.heartbeat("prefill-0", epoch=e.prefill, ttl_ms=60_000, load=0.5)
    with pytest.raises(LedgerConflict, match="stale epoch"):
        ledger.deregister_worker("prefill-0", epoch=e.prefill)
    # Block claims: a newer instance supersedes an older one, never the reverse.
    ledger.claim_blocks(
        "r1", "decode-0", epoch=e.decode, pool=Pool.TARGET, block_ids=[1, 2], lease_ms=LEASE_MS
    )
    new_decode = ledger.register_worker(
        "decode-0", role=WorkerRole.DECODE, address="127.0.0.1:3", capacity=128, ttl_ms=60_000
    )
    assert (
        ledger.claim_blocks(
            "r1", "decode-0", epoch=new_decode, pool=Pool.TARGET, block_ids=[7], lease_ms=LEASE_MS
        )
        == 1
    )
    for stale_call in (
        lambda: ledger.claim_blocks(
            "r1", "decode-0", epoch=e.decode, pool=Pool.TARGET, block_ids=[3], lease_ms=LEASE_MS
        ),
        lambda: ledger.renew_lease("r1", "decode-0", epoch=e.decode, lease_ms=LEASE_MS),
        lambda: ledger.release_blocks("r1", "decode-0", epoch=e.decode),
    ):
        with pytest.raises(
            LedgerConflict,
            match=f"stale epoch for worker decode-0: expected {new_decode}, got {e.decode}",
        ):
            stale_call()
    [holding] = ledger.holdings()
    assert (holding.epoch, holding.blocks[Pool.TARGET]) == (new_decode, frozenset({7}))


def test_claim_release_and_ended_requests(ledger: Ledger) -> None:
    e = _register(ledger)
    _drive(ledger, "r1", S.QUEUED, e)
    assert (
        ledger.claim_blocks(
            "r1",
            "decode-0",
            epoch=e.decode,
            pool=Pool.TARGET,
            block_ids=[4, 5, 6],
            lease_ms=LEASE_MS,
        )
        == 3
    )
    assert (
        ledger.claim_blocks(
            "r1", "decode-0", epoch=e.decode, pool=Pool.TARGET, block_ids=[6, 7], lease_ms=LEASE_MS
        )
        == 4
    )
    assert (
        ledger.claim_blocks(
            "r1",
            "decode-0",
            epoch=e.decode,
            pool=Pool.DRAFT,
            block_ids=range(4, 8),
            lease_ms=LEASE_MS,
        )
        == 4
    )
    many = range(100, 100 + 2500)  # more than one Lua unpack() batch
    assert (
        ledger.claim_blocks(
            "r1", "prefill-0", epoch=e.prefill, pool=Pool.TARGET, block_ids=many, lease_ms=LEASE_MS
        )
        == 2500
    )
    by_worker = {h.worker_id: h for h in ledger.holdings()}
    assert by_worker["decode-0"].blocks == {Pool.TARGET: {4, 5, 6, 7}, Pool.DRAFT: {4, 5, 6, 7}}
    assert (
        by_worker["decode-0"].is_request_live and 0 < by_worker["decode-0"].lease_ttl_ms <= LEASE_MS
    )
    assert ledger.holdings("prefill-0")[0].blocks[Pool.TARGET] == frozenset(many)

    assert (
        ledger.release_blocks("r1", "decode-0", epoch=e.decode, pool=Pool.TARGET, block_ids=[4, 99])
        == 1
    )
    assert ledger.release_blocks("r1", "decode-0", epoch=e.decode, pool=Pool.DRAFT) == 4
    assert ledger.release_blocks("r1", "decode-0", epoch=e.decode) == 3
    assert ledger.release_blocks("r1", "decode-0", epoch=e.decode) == 0  # idempotent
    assert (
        ledger.release_blocks("r1", "prefill-0", epoch=e.prefill, pool=Pool.TARGET, block_ids=many)
        == 2500
    )
    assert ledger.holdings() == []
    with pytest.raises(LedgerConflict, match="found none"):
        ledger.renew_lease("r1", "decode-0", epoch=e.decode, lease_ms=LEASE_MS)

    ledger.transition("r1", S.CANCELLED, expected=S.QUEUED, epoch=e.router)
    with pytest.raises(LedgerConflict, match="expected a live request, found CANCELLED"):
        ledger.claim_blocks(
            "r1", "decode-0", epoch=e.decode, pool=Pool.TARGET, block_ids=[1], lease_ms=LEASE_MS
        )
    with pytest.raises(LedgerConflict, match="found no record"):
        ledger.claim_blocks(
            "nope", "decode-0", epoch=e.decode, pool=Pool.TARGET, block_ids=[1], lease_ms=LEASE_MS
        )
    with pytest.raises(ValueError, match="block_ids"):
        ledger.claim_blocks(
            "r1", "decode-0", epoch=e.decode, pool=Pool.TARGET, block_ids=[-1], lease_ms=LEASE_MS
        )
    with pytest.raises(ValueError, match="request_id"):
        ledger.create_request("a{b}", owner="router-0", epoch=e.router)


def test_resize_follows_the_owners_allocator(ledger: Ledger) -> None:
    """A decode worker's table grows (and shrinks) while it decodes: recorded in both pools
    in one script that checks the state, the owner's epoch, the lease and the count the
    worker last recorded; an empty table ends the holding as a release does."""
    e = _register(ledger)
    for rid, block_ids in (("r1", [4, 5]), ("r2", [20, 21])):
        _drive(ledger, rid, S.DECODING, e)
        for pool in Pool:
            ledger.claim_blocks(
                rid, "decode-0", epoch=e.decode, pool=pool, block_ids=block_ids, lease_ms=LEASE_MS
            )

    def resize(
        added: Sequence[int],
        removed: Sequence[int] = (),
        *,
        num_held: int,
        rid: str = "r1",
        epoch: int = e.decode,
        has_draft: bool = True,
    ) -> int:
        return ledger.resize_blocks(
            rid,
            "decode-0",
            epoch=epoch,
            num_held=num_held,
            added=added,
            removed=removed,
            has_draft=has_draft,
        )

    assert resize([6, 7], num_held=2) == 4
    many = range(100, 100 + 2500)  # more than one Lua unpack() batch
    assert resize(many, [4], num_held=4) == 2503
    r1 = {h.request_id: h for h in ledger.holdings()}["r1"]
    assert r1.blocks == {Pool.TARGET: {5, 6, 7, *many}, Pool.DRAFT: {5, 6, 7, *many}}
    assert resize([], many, num_held=2503, has_draft=False) == 3  # the draft pool is kept
    r1 = {h.request_id: h for h in ledger.holdings()}["r1"]
    assert r1.blocks == {Pool.TARGET: {5, 6, 7}, Pool.DRAFT: {5, 6, 7, *many}}
    ledger.release_blocks("r1", "decode-0", epoch=e.decode, pool=Pool.DRAFT, block_ids=many)
    assert ledger.audit({"decode-0": {5, 6, 7, 20, 21}}) == []

    with pytest.raises(LedgerConflict, match="expected 4 blocks held by worker decode-0, found 3"):
        resize([8], num_held=4)  # an update this worker made was lost
    with pytest.raises(LedgerConflict, match="stale epoch: expected owner decode-0 at epoch"):
        resize([8], num_held=3, epoch=e.prefill)
    assert resize([], [5, 6, 7], num_held=3) == 0
    assert [h.request_id for h in ledger.holdings()] == ["r2"]
    with pytest.raises(LedgerConflict, match="expected blocks held by worker decode-0 at epoch"):
        resize([8], num_held=0)
    ledger.transition("r1", S.FINISHED, expected=S.DECODING, epoch=e.decode)
    with pytest.raises(LedgerConflict, match="r1: expected state DECODING, found FINISHED"):
        resize([8], num_held=0)
    ledger.client.delete(ledger._request_keys("r2", "decode-0")[2])  # r2's lease expired
    with pytest.raises(LedgerConflict, match="lease of worker decode-0 expected alive"):
        resize([8], num_held=2, rid="r2")
    assert {h.request_id: h.blocks[Pool.TARGET] for h in ledger.holdings()} == {"r2": {20, 21}}


def test_expired_lease_is_reaped(ledger: Ledger) -> None:
    e = _register(ledger)
    for rid in ("kept", "lost"):
        _drive(ledger, rid, S.DECODING, e)
        ledger.claim_blocks(
            rid, "decode-0", epoch=e.decode, pool=Pool.TARGET, block_ids=[1, 2], lease_ms=500
        )
        ledger.claim_blocks(
            rid, "decode-0", epoch=e.decode, pool=Pool.DRAFT, block_ids=[1], lease_ms=500
        )
    assert ledger.reap_expired() == []
    for _ in range(5):  # "kept" is renewed past its first lease, "lost" is not
        time.sleep(0.15)
        ledger.renew_lease("kept", "decode-0", epoch=e.decode, lease_ms=500)
    with pytest.raises(
        LedgerConflict, match="lease of worker decode-0 expected alive, found expired"
    ):
        ledger.renew_lease("lost", "decode-0", epoch=e.decode, lease_ms=300)
    with pytest.raises(LedgerConflict, match="found expired"):
        ledger.claim_blocks(
            "lost", "decode-0", epoch=e.decode, pool=Pool.TARGET, block_ids=[3], lease_ms=300
        )

    [reclaimed] = ledger.reap_expired()
    assert (reclaimed.request_id, reclaimed.worker_id, reclaimed.epoch) == (
        "lost",
        "decode-0",
        e.decode,
    )
    assert reclaimed.blocks == {Pool.TARGET: {1, 2}, Pool.DRAFT: {1}}
    assert ledger.reap_expired() == []
    assert [h.request_id for h in ledger.holdings()] == ["kept"]
    assert _record(ledger, "lost").state is S.DECODING
    # Once "kept" is released, its index entry goes at the next reap after its lease.
    ledger.release_blocks("kept", "decode-0", epoch=e.decode)
    time.sleep(0.55)
    assert ledger.reap_expired() == []
    assert ledger.client.zcard(ledger._holdings_key) == 0


def test_worker_registry_and_heartbeat_expiry(ledger: Ledger) -> None:
    e = _register(ledger, ttl_ms=400)
    workers = ledger.list_workers()
    assert [w.worker_id for w in workers] == ["decode-0", "prefill-0", "router-0"]
    [decode] = ledger.list_workers(WorkerRole.DECODE)
    assert (decode.role, decode.address, decode.capacity, decode.epoch, decode.load) == (
        WorkerRole.DECODE,
        "127.0.0.1:3",
        128,
        e.decode,
        0.0,
    )
    for _ in range(5):  # 0.75 s: only the decode worker heartbeats
        time.sleep(0.15)
        ledger.heartbeat(
            "decode-0", epoch=e.decode, ttl_ms=400, load=0.25, stats={"num_running": 3}
        )
    [decode] = ledger.list_workers()
    assert (decode.worker_id, decode.load, decode.stats) == ("decode-0", 0.25, {"num_running": "3"})
    assert decode.heartbeat_ms > decode.registered_ms
    with pytest.raises(LedgerConflict, match="register again"):
        ledger.heartbeat("prefill-0", epoch=e.prefill, ttl_ms=400, load=0.0)
    assert ledger.client.smembers(f"{ledger.ns}:workers") == {"decode-0"}  # pruned
    again = ledger.register_worker(
        "prefill-0", role=WorkerRole.PREFILL, address="127.0.0.1:2", capacity=64, ttl_ms=400
    )
    assert again > e.decode
    assert ledger.deregister_worker("decode-0", epoch=e.decode) is True
    assert ledger.deregister_worker("decode-0", epoch=e.decode) is False
    assert [w.worker_id for w in ledger.list_workers()] == ["prefill-0"]


def test_epochs_keep_growing_across_a_redis_restart() -> None:
    epochs = []
    for _ in range(2):  # two fresh servers: the counter is seeded from the server clock
        with RedisServer() as server:
            ledger = Ledger(server.client(decode_responses=True))
            epochs += [
                ledger.register_worker(
                    "w", role=WorkerRole.DECODE, address="a:1", capacity=1, ttl_ms=1000
                )
                for _ in range(2)
            ]
    assert epochs == sorted(set(epochs))


def test_generation_is_set_once_per_lifetime_of_the_data(ledger: Ledger) -> None:
    first = ledger.join_generation("w1")
    assert len(first.id) == 16 and first.tick == 1
    assert ledger.join_generation("w1", first) == Generation(first.id, first.started_ms, 2)
    assert ledger.join_generation("w2") == Generation(first.id, first.started_ms, 1)  # its own
    for key in ledger.client.scan_iter(match=f"{ledger.ns}:*"):  # restarted empty
        ledger.client.delete(key)
    second = ledger.join_generation("w1", first)
    assert second.id != first.id and second.tick == 1 and second.started_ms >= first.started_ms
    assert ledger.join_generation("w1", second).id == second.id


def test_a_redis_restored_from_a_snapshot_starts_a_new_generation(tmp_path: Path) -> None:
    """Restored from a snapshot, Redis has the generation it had, with the clock of a
    component that heartbeat since behind what it read: that component begins a new
    generation, which the others see at their next look, whatever they read before.
    Epochs handed out since the snapshot are not handed out again, and a decode worker's
    rebuilt records replace the images the snapshot brought back, not a record changed
    since the generation began, nor an ended one."""
    with RedisServer(port=free_port()) as server:  # TCP: restarted where the client looks
        ledger = Ledger(server.client(decode_responses=True))
        e = _register(ledger)
        router_seen = ledger.join_generation("router-0")
        decode_seen = ledger.join_generation("decode-0")
        _drive(ledger, "r1", S.DECODING, e)
        ledger.claim_blocks(
            "r1", "decode-0", epoch=e.decode, pool=Pool.TARGET, block_ids=[1, 2], lease_ms=LEASE_MS
        )
        _drive(ledger, "r2", S.TRANSFERRING, e)
        _drive(ledger, "r5", S.FINISHED, e)
        snapshot = server.save(tmp_path / "dump.rdb")

        for _ in range(2):  # heartbeats after the snapshot
            decode_seen = ledger.join_generation("decode-0", decode_seen)
        _drive(ledger, "r3", S.DECODING, e)  # begun after the snapshot: lost with it
        since = ledger.register_worker(
            "decode-0", role=WorkerRole.DECODE, address="127.0.0.1:3", capacity=128, ttl_ms=60_000
        )
        assert since > e.decode
        server.crash()
        server.start(rdb=snapshot)

        for _ in range(3):  # the router read nothing since the snapshot: no clue alone
            router_seen = ledger.join_generation("router-0", router_seen)
            assert router_seen.id == decode_seen.id
        restored = ledger.join_generation("decode-0", decode_seen)
        assert restored.id != decode_seen.id and restored.started_ms > decode_seen.started_ms
        assert ledger.join_generation("router-0", router_seen).id == restored.id
        assert ledger.join_generation("decode-0", decode_seen).id == restored.id  # begun once
        new_epoch = ledger.register_worker(
            "decode-0", role=WorkerRole.DECODE, address="127.0.0.1:3", capacity=128, ttl_ms=60_000
        )
        assert new_epoch > since

        old_records = {rid: _record(ledger, rid).state for rid in ("r1", "r2", "r5")}
        assert old_records == {"r1": S.DECODING, "r2": S.TRANSFERRING, "r5": S.FINISHED}
        _drive(ledger, "r4", S.QUEUED, e)  # recorded since the generation began
        restore = {"epoch": new_epoch, "lease_ms": LEASE_MS, "has_draft": False}
        assert ledger.get_request("r3") is None
        for rid, block_ids in (("r1", [1, 2, 3, 4]), ("r2", [7]), ("r3", [9])):
            record = ledger.restore_decoding(
                rid, "decode-0", block_ids=block_ids, stale_before_ms=restored.started_ms, **restore
            )
            assert (record.state, record.owner, record.epoch) == (S.DECODING, "decode-0", new_epoch)
        for rid, state in (("r4", "QUEUED"), ("r5", "FINISHED")):
            with pytest.raises(LedgerConflict, match=f"expected no record to restore.*{state}"):
                ledger.restore_decoding(
                    rid, "decode-0", block_ids=[8], stale_before_ms=restored.started_ms, **restore
                )
        assert {h.request_id: (h.epoch, h.blocks[Pool.TARGET]) for h in ledger.holdings()} == {
            "r1": (new_epoch, {1, 2, 3, 4}),
            "r2": (new_epoch, {7}),
            "r3": (new_epoch, {9}),
        }
        ledger.client.close()


def test_restore_decoding_after_a_restart(ledger: Ledger) -> None:
    """The decode worker's rebuilt record: DECODING and its own at its new epoch, its
    blocks under a lease; it ends, or goes back to the router at the router's old epoch,
    as the original would have. A record that exists is never overwritten."""
    e = _register(ledger)
    new_epoch = ledger.register_worker(
        "decode-0", role=WorkerRole.DECODE, address="127.0.0.1:3", capacity=128, ttl_ms=60_000
    )
    fields = {"model": "m", "num_prompt_tokens": 5, "router": "router-0", "router_epoch": e.router}
    record = ledger.restore_decoding(
        "r1",
        "decode-0",
        epoch=new_epoch,
        block_ids=[4, 5, 6],
        has_draft=True,
        lease_ms=LEASE_MS,
        fields=fields,
    )
    assert (record.state, record.owner, record.epoch, record.version) == (
        S.DECODING,
        "decode-0",
        new_epoch,
        0,
    )
    assert {k: v for k, v in record.fields.items() if k != "restored_ms"} == {
        k: str(v) for k, v in fields.items()
    }
    [holding] = ledger.holdings()
    assert (holding.request_id, holding.epoch) == ("r1", new_epoch)
    assert holding.request_state is S.DECODING
    assert holding.blocks == {Pool.TARGET: {4, 5, 6}, Pool.DRAFT: {4, 5, 6}}
    assert 0 < holding.lease_ttl_ms <= LEASE_MS
    with pytest.raises(LedgerConflict, match="expected no record to restore, found one"):
        ledger.restore_decoding(
            "r1", "decode-0", epoch=new_epoch, block_ids=[7], has_draft=False, lease_ms=LEASE_MS
        )
    with pytest.raises(LedgerConflict, match="stale epoch"):
        ledger.transition("r1", S.FINISHED, expected=S.DECODING, epoch=e.decode)
    with pytest.raises(ValueError, match="reserved"):
        ledger.restore_decoding(
            "r2", "decode-0", epoch=new_epoch, block_ids=[], has_draft=False, lease_ms=1,
            fields={"restored_ms": 1},
        )  # fmt: skip

    # Preempted: handed back to the router at the epoch the router used for it.
    assert ledger.release_blocks("r1", "decode-0", epoch=new_epoch) == 6
    ledger.transition(
        "r1",
        S.QUEUED,
        expected=S.DECODING,
        epoch=new_epoch,
        new_owner="router-0",
        new_epoch=e.router,
    )
    ledger.transition("r1", S.CANCELLED, expected=S.QUEUED, epoch=e.router)
    ledger.restore_decoding(
        "r3", "decode-0", epoch=new_epoch, block_ids=[1], has_draft=False, lease_ms=LEASE_MS
    )
    ledger.release_blocks("r3", "decode-0", epoch=new_epoch)
    assert ledger.transition("r3", S.FINISHED, expected=S.DECODING, epoch=new_epoch).version == 1
    assert ledger.holdings() == [] and ledger.audit({"decode-0": set()}) == []


def test_prefix_index(ledger: Ledger) -> None:
    ledger.publish_prefix(["decode-0"], ["h1", "h2", "h3"], ttl_ms=60_000)
    ledger.publish_prefix(["decode-1"], ["h1", "h2"], ttl_ms=60_000)
    ledger.publish_prefix(["decode-2"], ["h1"], ttl_ms=300)
    assert ledger.match_prefix(["h1", "h2", "h3", "h4"]) == {
        "decode-0": 3,
        "decode-1": 2,
        "decode-2": 1,
    }
    assert ledger.match_prefix(["h2"]) == {"decode-0": 1, "decode-1": 1}
    assert ledger.match_prefix(["h9", "h1"]) == {}
    ledger.withdraw_prefix("decode-0", ["h2"])
    time.sleep(0.35)
    assert ledger.match_prefix(["h1", "h2", "h3"]) == {"decode-0": 1, "decode-1": 2}


def test_concurrent_transitions_from_two_clients(redis_server: RedisServer) -> None:
    """Two clients race random transitions on the same request from possibly stale views
    until it ends; the successes of both, ordered by version, must form one legal path."""
    namespace = f"race{random.randrange(10**9)}"
    clients = [redis_server.client(decode_responses=True) for _ in range(2)]
    ledgers = [Ledger(client, namespace=namespace) for client in clients]
    epoch = 42  # one owner epoch throughout: the race is on states
    request_ids = [f"r{i}" for i in range(30)]
    for rid in request_ids:
        ledgers[0].create_request(rid, owner="router-0", epoch=epoch)
    successes: list[tuple[str, int, RequestState, RequestState]] = []
    num_conflicts = [0, 0]
    # Favour progress; hand-backs (DECODING -> QUEUED) make some paths long.
    weights = {S.QUEUED: 2.0, S.CANCELLED: 0.2, S.FAILED: 0.2}
    barrier = threading.Barrier(2)

    def run(me: int) -> None:
        rng = random.Random(me)
        for rid in request_ids:
            barrier.wait(timeout=30)  # both clients on the same request at once
            while True:
                record = ledgers[me].get_request(rid)
                assert record is not None
                targets = sorted(ALLOWED_TRANSITIONS[record.state])
                if not targets:
                    break
                to = rng.choices(targets, [weights.get(t, 6.0) for t in targets])[0]
                try:
                    new = ledgers[me].transition(rid, to, expected=record.state, epoch=epoch)
                except LedgerConflict:
                    num_conflicts[me] += 1
                    continue
                successes.append((rid, new.version, record.state, to))  # list.append: atomic

    with ThreadPoolExecutor(2) as pool:
        for future in [pool.submit(run, i) for i in range(2)]:
            future.result()  # re-raises a failure inside a thread

    assert sum(num_conflicts) > 0, "the two clients never raced"
    for rid in request_ids:
        steps = sorted(s[1:] for s in successes if s[0] == rid)
        assert [v for v, _, _ in steps] == list(range(1, len(steps) + 1)), rid
        state = S.QUEUED
        for _, prev, to in steps:
            assert prev is state and to in ALLOWED_TRANSITIONS[prev], (rid, steps)
            state = to
        assert state.is_terminal
        assert _record(ledgers[0], rid).state is state
    for client in clients:
        client.close()

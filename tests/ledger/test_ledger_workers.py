"""The Redis ledger against a real redis-server: workers, generations, restores, the
prefix index, and concurrent clients."""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from ledger.ledger import (
    ALLOWED_TRANSITIONS,
    Generation,
    KvPool,
    Ledger,
    LedgerConflict,
    RequestState,
    WorkerRole,
)
from ledger.redis_server import RedisServer, free_port
from tests.ledger.ledger_helpers import LEASE_MS, S, drive, record_of, register


def test_worker_registry_and_heartbeat_expiry(ledger: Ledger) -> None:
    e = register(ledger, ttl_ms=400)
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
        e = register(ledger)
        router_seen = ledger.join_generation("router-0")
        decode_seen = ledger.join_generation("decode-0")
        drive(ledger, "r1", S.DECODING, e)
        ledger.claim_blocks(
            "r1",
            "decode-0",
            epoch=e.decode,
            pool=KvPool.TARGET,
            block_ids=[1, 2],
            lease_ms=LEASE_MS,
        )
        drive(ledger, "r2", S.TRANSFERRING, e)
        drive(ledger, "r5", S.FINISHED, e)
        snapshot = server.save(tmp_path / "dump.rdb")

        for _ in range(2):  # heartbeats after the snapshot
            decode_seen = ledger.join_generation("decode-0", decode_seen)
        drive(ledger, "r3", S.DECODING, e)  # begun after the snapshot: lost with it
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

        old_records = {rid: record_of(ledger, rid).state for rid in ("r1", "r2", "r5")}
        assert old_records == {"r1": S.DECODING, "r2": S.TRANSFERRING, "r5": S.FINISHED}
        drive(ledger, "r4", S.QUEUED, e)  # recorded since the generation began
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
        assert {h.request_id: (h.epoch, h.blocks[KvPool.TARGET]) for h in ledger.holdings()} == {
            "r1": (new_epoch, {1, 2, 3, 4}),
            "r2": (new_epoch, {7}),
            "r3": (new_epoch, {9}),
        }
        ledger.client.close()


def test_restore_decoding_after_a_restart(ledger: Ledger) -> None:
    """The decode worker's rebuilt record: DECODING and its own at its new epoch, its
    blocks under a lease; it ends, or goes back to the router at the router's old epoch,
    as the original would have. A record that exists is never overwritten."""
    e = register(ledger)
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
    assert holding.blocks == {KvPool.TARGET: {4, 5, 6}, KvPool.DRAFT: {4, 5, 6}}
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
    assert ledger.free_blocks("r1", "decode-0", epoch=new_epoch) == 6
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
    ledger.free_blocks("r3", "decode-0", epoch=new_epoch)
    assert ledger.transition("r3", S.FINISHED, expected=S.DECODING, epoch=new_epoch).version == 1
    assert ledger.holdings() == [] and ledger.audit({"decode-0": set()}) == []


def test_prefix_index(ledger: Ledger) -> None:
    ledger.prefixes.publish(["decode-0"], ["h1", "h2", "h3"], ttl_ms=60_000)
    ledger.prefixes.publish(["decode-1"], ["h1", "h2"], ttl_ms=60_000)
    ledger.prefixes.publish(["decode-2"], ["h1"], ttl_ms=300)
    assert ledger.prefixes.match(["h1", "h2", "h3", "h4"]) == {
        "decode-0": 3,
        "decode-1": 2,
        "decode-2": 1,
    }
    assert ledger.prefixes.match(["h2"]) == {"decode-0": 1, "decode-1": 1}
    assert ledger.prefixes.match(["h9", "h1"]) == {}
    ledger.prefixes.withdraw("decode-0", ["h2"])
    time.sleep(0.35)
    assert ledger.prefixes.match(["h1", "h2", "h3"]) == {"decode-0": 1, "decode-1": 2}


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
        assert record_of(ledgers[0], rid).state is state
    for client in clients:
        client.close()

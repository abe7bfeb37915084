"""The ledger's scripts on a 3-node Redis Cluster: every script's keys share one slot."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from redis.cluster import RedisCluster

from ledger.ledger import (
    KvPool,
    Ledger,
    LedgerConflict,
    RequestRecord,
    RequestState,
    WorkerRole,
)
from ledger.redis_server import LocalRedisCluster

S = RequestState


def _record(ledger: Ledger, request_id: str) -> RequestRecord:
    record = ledger.get_request(request_id)
    assert record is not None, f"no record of {request_id}"
    return record


@pytest.fixture(scope="module")
def redis_cluster() -> Iterator[LocalRedisCluster]:
    with LocalRedisCluster(num_nodes=3) as cluster:
        yield cluster


def test_ledger_on_redis_cluster(redis_cluster: LocalRedisCluster) -> None:
    client: RedisCluster = redis_cluster.client()  # bytes replies: the ledger decodes them
    ledger = Ledger(client, finished_ttl_ms=5000)
    router = ledger.register_worker(
        "router-0", role=WorkerRole.ROUTER, address="127.0.0.1:1", capacity=0, ttl_ms=60_000
    )
    decode = ledger.register_worker(
        "decode-0", role=WorkerRole.DECODE, address="127.0.0.1:3", capacity=64, ttl_ms=60_000
    )
    request_ids = [f"req-{i}" for i in range(12)]
    slots = {client.keyslot(ledger.keys.record(rid)) for rid in request_ids}
    nodes = {client.get_node_from_key(ledger.keys.record(rid)).name for rid in request_ids}
    assert len(slots) == len(request_ids) and len(nodes) == 3  # spread over every node

    for rid in request_ids:
        ledger.create_request(rid, owner="router-0", epoch=router, fields={"model": "m"})
        ledger.transition(
            rid,
            S.PREFILLING,
            expected=S.QUEUED,
            epoch=router,
            new_owner="decode-0",
            new_epoch=decode,
        )
        ledger.claim_blocks(
            rid, "decode-0", epoch=decode, pool=KvPool.TARGET, block_ids=[1, 2], lease_ms=60_000
        )
        ledger.claim_blocks(
            rid, "decode-0", epoch=decode, pool=KvPool.DRAFT, block_ids=[1, 2], lease_ms=250
        )
        ledger.renew_lease(rid, "decode-0", epoch=decode, lease_ms=250)
        with pytest.raises(LedgerConflict, match="stale epoch"):
            ledger.transition(rid, S.TRANSFERRING, expected=S.PREFILLING, epoch=router)
        for to in (S.TRANSFERRING, S.DECODING, S.FINISHED):
            prev = _record(ledger, rid).state
            ledger.transition(rid, to, expected=prev, epoch=decode)
    assert {_record(ledger, rid).state for rid in request_ids} == {S.FINISHED}
    assert len(ledger.holdings("decode-0")) == len(request_ids)

    ledger.free_blocks(request_ids[0], "decode-0", epoch=decode)
    time.sleep(0.3)
    reclaimed = ledger.reap_expired()
    assert sorted(r.request_id for r in reclaimed) == sorted(request_ids[1:])
    assert all(r.blocks == {KvPool.TARGET: {1, 2}, KvPool.DRAFT: {1, 2}} for r in reclaimed)
    assert ledger.holdings() == []

    # After a restart: the generation key, and a rebuilt record with its blocks.
    generation = ledger.join_generation("w")
    assert ledger.join_generation("w", generation).id == generation.id
    ledger.restore_decoding(
        "restored", "decode-0", epoch=decode, block_ids=[7, 8], has_draft=True, lease_ms=60_000
    )
    [restored] = ledger.holdings("decode-0")
    assert restored.blocks == {KvPool.TARGET: {7, 8}, KvPool.DRAFT: {7, 8}}
    assert restored.request_state is S.DECODING
    ledger.free_blocks("restored", "decode-0", epoch=decode)
    ledger.transition("restored", S.FINISHED, expected=S.DECODING, epoch=decode)

    ledger.heartbeat("decode-0", epoch=decode, ttl_ms=60_000, load=0.5)
    assert [w.worker_id for w in ledger.list_workers(WorkerRole.DECODE)] == ["decode-0"]
    assert ledger.deregister_worker("router-0", epoch=router)
    ledger.prefixes.publish(["decode-0"], ["a1", "a2"], ttl_ms=60_000)
    assert ledger.prefixes.match(["a1", "a2", "a3"]) == {"decode-0": 2}
    assert ledger.audit({"decode-0": set()}) == []
    client.close()

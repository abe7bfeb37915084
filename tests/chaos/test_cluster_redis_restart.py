"""The ledger's Redis dies under a running cluster (a real redis-server, killed with
SIGKILL and started again on its port; router, prefill and decode workers as real
processes), and comes back empty, or restored from a snapshot taken mid-stream (SAVE).
While it is down, a new request fails at once with UNAVAILABLE naming Redis. Once it is
back, every component sees a new ledger generation (none, or the snapshot's with their
clocks in it behind what they had read) and registers again with a new epoch; the decode
worker records again the requests it is decoding (DECODING, its own at its new epoch, the
blocks its allocator holds for them, replacing what a snapshot brought back), so their
streams go on with no migration and no second prefill, and complete equal to the
in-process engine (up to a tie, `tests.comparator`); the ledger agrees with the
allocators mid-decode; new requests are served; the new ledger ends clean."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import redis
import torch

from ledger.ledger import Holding, KvPool, Ledger, RequestRecord, RequestState
from ledger.redis_server import RedisServer, free_port
from serving.launcher import Cluster
from tests.services.cluster_helpers import (
    Streams,
    assert_greedy_equal,
    audit_live,
    build_tiny_target,
    check_stream,
    engine_greedy,
    generate_all,
    metric,
    router_counter,
    run,
    start_streams,
    tiny_cluster_spec,
    wait_audit_clean,
    worker_stats,
)

# About 4 s of decoding here: every stream is mid-way through the checks, which wait on
# 300 ms heartbeats (300 tokens ended before them in a CI run).
MAX_TOKENS = 1500
PROMPTS = [[(3 * i + 7 * j) % 61 + 3 for j in range(6 + 4 * i)] for i in range(3)]
LATER_PROMPTS = [[9, 4, 33, 20, 5], [17, 60, 3, 3, 41, 8, 25, 12, 7]]
LATER_MAX_TOKENS = 32  # served after the restart: short
TOKENS_BEFORE_KILL = 8
DECODE = "decode-0"


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.set_num_threads(1)  # this process shares the cores with the cluster's
    return build_tiny_target(tmp_path_factory.mktemp("redis_restart") / "target")


@pytest.fixture(scope="module")
def expected(target: Path) -> list[list[int]]:
    """The in-process engine's greedy output for PROMPTS, then LATER_PROMPTS."""
    streams = engine_greedy(target, PROMPTS, MAX_TOKENS)
    return streams + engine_greedy(target, LATER_PROMPTS, LATER_MAX_TOKENS)


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    """On a fixed TCP port, so that the restarted server is where the cluster looks."""
    server = RedisServer(port=free_port()).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def cluster(
    target: Path, redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    spec = tiny_cluster_spec(target, tmp_path_factory.mktemp("logs"), redis=redis_server.settings)
    with Cluster(spec) as cluster:
        yield cluster


@pytest.fixture
def ledger(cluster: Cluster) -> Iterator[Ledger]:
    client = redis.Redis.from_url(cluster.redis_url, decode_responses=True)
    yield Ledger(client)
    client.close()


def epochs(ledger: Ledger) -> dict[str, int]:
    return {w.worker_id: w.epoch for w in ledger.list_workers() if w.stats.get("model")}


def decode_holdings(ledger: Ledger) -> dict[str, Holding]:
    return {h.request_id: h for h in ledger.holdings(DECODE)}


def decoding_records(ledger: Ledger, streams: Streams) -> dict[str, RequestRecord]:
    records: dict[str, RequestRecord] = {}
    for rid in streams.request_ids:
        record = ledger.get_request(rid)
        assert record is not None and record.state is RequestState.DECODING
        records[rid] = record
    return records


async def kill_redis_and_refuse(cluster: Cluster, redis_server: RedisServer) -> None:
    """SIGKILL (nothing saved); while it is down, a new request is refused at once,
    saying why."""
    redis_server.crash()  # its directory goes
    started = time.monotonic()
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await run(cluster.router_address, LATER_PROMPTS[0], max_tokens=4)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "Redis is unreachable" in (refused.value.details() or "")
    assert time.monotonic() - started < 5


async def wait_rebuilt(ledger: Ledger, request_ids: list[str], old_epoch: int) -> int:
    """The decode worker's new epoch, once every request is recorded again under it."""
    deadline = time.monotonic() + 10
    while True:
        epoch = epochs(ledger).get(DECODE, old_epoch)
        records = [ledger.get_request(rid) for rid in request_ids]
        if epoch > old_epoch and all(r is not None and r.epoch == epoch for r in records):
            return epoch
        assert time.monotonic() < deadline, f"not rebuilt within 10 s: {records}"
        await asyncio.sleep(0.05)


async def check_rebuilt(
    cluster: Cluster,
    ledger: Ledger,
    streams: Streams,
    old_records: dict[str, RequestRecord],
    before: dict[str, int],
) -> dict[str, Holding]:
    """Rebuilt from the decode worker: its records, at its new epoch, with the fields the
    router gave, holding blocks all in its allocator; the ledger agrees with every
    allocator while the streams decode; every component registered again. Returns the
    decode worker's holdings."""
    new_epoch = await wait_rebuilt(ledger, streams.request_ids, before[DECODE])
    rebuilt = decode_holdings(ledger)  # first: the allocator can only be ahead
    stats = await worker_stats(cluster.decode[0], include_block_ids=True)
    for rid, old in old_records.items():
        record = ledger.get_request(rid)
        assert record is not None
        assert (record.state, record.owner, record.epoch) == (
            RequestState.DECODING,
            DECODE,
            new_epoch,
        )
        assert "restored_ms" in record.fields
        for name in ("model", "num_prompt_tokens", "decode_worker"):
            assert record.fields[name] == old.fields[name], name
        holding = rebuilt[rid]
        assert holding.epoch == new_epoch and holding.lease_ttl_ms > 0
    owned = set(stats.owned_block_ids)
    assert set().union(*(h.blocks[KvPool.TARGET] for h in rebuilt.values())) <= owned
    assert await audit_live(cluster, ledger) == []  # blocks grown since: recorded
    assert max(streams.counts) < MAX_TOKENS, "a stream ended before the checks: raise MAX_TOKENS"
    await wait_registered_again(ledger, before)
    return rebuilt


async def wait_registered_again(ledger: Ledger, before: dict[str, int]) -> None:
    """Every component of `before` registered again, at a later epoch. Each registers on
    its own heartbeat, so the prefill worker may come back after the decode worker."""
    deadline = time.monotonic() + 10
    while True:
        after = epochs(ledger)
        if set(after) == set(before) and all(after[w] > before[w] for w in before):
            return
        assert time.monotonic() < deadline, f"not registered again within 10 s: {before} -> {after}"
        await asyncio.sleep(0.05)


async def test_decoding_streams_survive_an_empty_redis_restart(
    cluster: Cluster,
    ledger: Ledger,
    redis_server: RedisServer,
    expected: list[list[int]],
    target: Path,
) -> None:
    before = epochs(ledger)
    assert set(before) == {"prefill-0", DECODE}  # the router: no model figure
    streams = await start_streams(
        cluster.router_address, PROMPTS, MAX_TOKENS, min_tokens=TOKENS_BEFORE_KILL
    )
    records = decoding_records(ledger, streams)
    claimed = decode_holdings(ledger)
    await kill_redis_and_refuse(cluster, redis_server)
    redis_server.start()  # empty, on the same port

    rebuilt = await check_rebuilt(cluster, ledger, streams, records, before)
    for rid, holding in rebuilt.items():  # at least what was claimed: the tables grew
        assert holding.blocks[KvPool.TARGET] >= claimed[rid].blocks[KvPool.TARGET]
    results = await streams.results()
    ours = [check_stream(c, MAX_TOKENS) for c in results]
    assert_greedy_equal(target, PROMPTS, ours, expected[: len(PROMPTS)])
    assert router_counter(cluster, "tandem_migrations_total") == 0
    prefills = metric(cluster.prefill[0], "tandem_prefill_seconds_count", "prefill")
    assert prefills == len(PROMPTS)  # none prefilled again

    later = await generate_all(cluster.router_address, LATER_PROMPTS, LATER_MAX_TOKENS)
    assert_greedy_equal(target, LATER_PROMPTS, later, expected[len(PROMPTS) :])
    await wait_audit_clean(cluster, ledger, within_s=10)


async def test_decoding_streams_survive_a_redis_restored_from_a_snapshot(
    cluster: Cluster,
    ledger: Ledger,
    redis_server: RedisServer,
    expected: list[list[int]],
    target: Path,
    tmp_path: Path,
) -> None:
    """The snapshot keeps the generation and the records of its time: the streams'
    records DECODING at the decode worker's epoch then, with the tables they had. The
    components' clocks in it are behind what they read since, which tells them."""
    before = epochs(ledger)
    prefills = metric(cluster.prefill[0], "tandem_prefill_seconds_count", "prefill")
    streams = await start_streams(
        cluster.router_address, PROMPTS, MAX_TOKENS, min_tokens=TOKENS_BEFORE_KILL
    )
    records = decoding_records(ledger, streams)
    snapshot = redis_server.save(tmp_path / "dump.rdb")
    at_snapshot = decode_holdings(ledger)

    # The ledger moves on: a request served start to end, tables grown, heartbeats.
    served, _ = await asyncio.gather(
        run(cluster.router_address, LATER_PROMPTS[0], max_tokens=8, temperature=0.0),
        wait_for_heartbeats_since(ledger, server_ms(ledger) + 100),  # a tick precedes each
    )
    grown = decode_holdings(ledger)
    for rid in records:
        assert grown[rid].blocks[KvPool.TARGET] > at_snapshot[rid].blocks[KvPool.TARGET]
    await kill_redis_and_refuse(cluster, redis_server)
    redis_server.start(rdb=snapshot)  # as it was at the snapshot, on the same port
    assert ledger.get_request(served[0].request_id) is None  # served after it: forgotten

    await check_rebuilt(cluster, ledger, streams, records, before)
    results = await streams.results()
    ours = [check_stream(c, MAX_TOKENS) for c in results]
    assert_greedy_equal(target, PROMPTS, ours, expected[: len(PROMPTS)])
    assert router_counter(cluster, "tandem_migrations_total") == 0
    num_prefills = metric(cluster.prefill[0], "tandem_prefill_seconds_count", "prefill")
    assert num_prefills == prefills + len(PROMPTS) + 1  # the streams, once, and the served one
    await wait_audit_clean(cluster, ledger, within_s=10)


def server_ms(ledger: Ledger) -> int:
    seconds, microseconds = ledger.client.time()
    return int(seconds) * 1000 + int(microseconds) // 1000


async def wait_for_heartbeats_since(ledger: Ledger, since_ms: int) -> None:
    """Until every component (the router too) heartbeat after ``since_ms`` (server clock)."""
    deadline = time.monotonic() + 10
    while not all(w.heartbeat_ms > since_ms for w in ledger.list_workers()):
        assert time.monotonic() < deadline, "no heartbeats within 10 s"
        await asyncio.sleep(0.05)

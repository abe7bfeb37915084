"""The ledger's Redis restarts empty under a running cluster (a real redis-server, killed
with SIGKILL and started again on its port; router, prefill and decode workers as real
processes). While it is down, a new request fails at once with UNAVAILABLE naming Redis.
Once it is back, every component sees a new ledger generation and registers again with a
new epoch; the decode worker records again the requests it is decoding (DECODING, its own
at its new epoch, the blocks its allocator holds for them), so their streams go on with
no migration and no second prefill, and complete equal to the in-process engine; new
requests are served; the new ledger ends clean."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import redis
import torch

from cluster.launcher import Cluster
from cluster.ledger import Holding, Ledger, Pool, RequestRecord, RequestState
from cluster.redis_server import RedisServer, free_port
from tests.services.cluster_helpers import (
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

MAX_TOKENS = 300  # long enough that every stream is mid-way until the checks are done
PROMPTS = [[(3 * i + 7 * j) % 61 + 3 for j in range(6 + 4 * i)] for i in range(3)]
LATER_PROMPTS = [[9, 4, 33, 20, 5], [17, 60, 3, 3, 41, 8, 25, 12, 7]]
TOKENS_BEFORE_KILL = 8
DECODE = "decode-0"


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.set_num_threads(1)  # this process shares the cores with the cluster's
    return build_tiny_target(tmp_path_factory.mktemp("redis_restart") / "target")


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    """On a fixed TCP port, so that the restarted server is where the cluster looks."""
    server = RedisServer(port=free_port()).start()
    yield server
    server.stop()


def epochs(ledger: Ledger) -> dict[str, int]:
    return {w.worker_id: w.epoch for w in ledger.list_workers() if w.stats.get("model")}


def decode_holdings(ledger: Ledger) -> dict[str, Holding]:
    return {h.request_id: h for h in ledger.holdings(DECODE)}


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


async def test_decoding_streams_survive_an_empty_redis_restart(
    target: Path, redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> None:
    spec = tiny_cluster_spec(target, tmp_path_factory.mktemp("logs"), redis=redis_server.settings)
    with Cluster(spec) as cluster:
        client = redis.Redis.from_url(cluster.redis_url, decode_responses=True)
        ledger = Ledger(client)
        try:
            before = epochs(ledger)
            assert set(before) == {"prefill-0", DECODE}  # the router: no model figure
            streams = await start_streams(
                cluster.router_address, PROMPTS, MAX_TOKENS, min_tokens=TOKENS_BEFORE_KILL
            )
            records: dict[str, RequestRecord] = {}
            for rid in streams.request_ids:
                record = ledger.get_request(rid)
                assert record is not None and record.state is RequestState.DECODING
                records[rid] = record
            claimed = decode_holdings(ledger)
            assert redis_server.process is not None
            redis_server.process.kill()  # SIGKILL: nothing saved
            redis_server.process.wait(timeout=10)

            # Down: a new request is refused at once, saying why.
            started = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await run(cluster.router_address, LATER_PROMPTS[0], max_tokens=4)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "Redis is unreachable" in (refused.value.details() or "")
            assert time.monotonic() - started < 5

            redis_server.stop()  # its directory goes: nothing was persisted anyway
            redis_server.start()  # empty, on the same port
            new_epoch = await wait_rebuilt(ledger, streams.request_ids, before[DECODE])

            # Rebuilt from the decode worker: its records, at its new epoch, holding at
            # least the blocks it had claimed (its tables grew since), all in its allocator.
            rebuilt = decode_holdings(ledger)  # first: the allocator can only be ahead
            stats = await worker_stats(cluster.decode[0], include_block_ids=True)
            assert max(streams.counts) < MAX_TOKENS, (
                "a stream ended before the checks: raise MAX_TOKENS"
            )
            for rid, old in records.items():
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
                assert holding.blocks[Pool.TARGET] >= claimed[rid].blocks[Pool.TARGET]
            owned = set(stats.owned_block_ids)
            assert set().union(*(h.blocks[Pool.TARGET] for h in rebuilt.values())) <= owned
            assert await audit_live(cluster, ledger) == []  # blocks grown since: recorded

            results = await streams.results()
            expected = engine_greedy(target, [*PROMPTS, *LATER_PROMPTS], MAX_TOKENS)
            assert [check_stream(c, MAX_TOKENS) for c in results] == expected[: len(PROMPTS)]
            assert router_counter(cluster, "tandem_migrations_total") == 0
            prefills = metric(cluster.prefill[0], "tandem_prefill_seconds_count", "prefill")
            assert prefills == len(PROMPTS)  # none prefilled again
            after = epochs(ledger)
            assert set(after) == set(before)
            assert all(after[w] > before[w] for w in before), (before, after)

            later = await generate_all(cluster.router_address, LATER_PROMPTS, MAX_TOKENS)
            assert later == expected[len(PROMPTS) :]
            await wait_audit_clean(cluster, ledger, within_s=10)
        finally:
            client.close()

"""A decode worker killed mid-stream (SIGKILL, real processes): the router takes its
requests back in the ledger and resumes them on the other decode worker (prompt + tokens
already sent, re-prefilled). The client sees no error, one contiguous stream, and the
same greedy tokens as the in-process engine; the dead worker's blocks are reclaimed by
the reaper when its lease expires, and nothing else is left held."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import torch

from ledger.ledger import Ledger
from serving.launcher import Cluster
from tests.services.cluster_helpers import (
    build_tiny_target,
    check_stream,
    engine_greedy,
    non_final_requests,
    router_counter,
    start_streams,
    tiny_cluster_spec,
    worker_stats,
)

MAX_TOKENS = 500  # long enough that every stream is mid-way when its worker is killed
PROMPTS = [[(5 * i + 3 * j) % 61 + 3 for j in range(5 + 3 * i)] for i in range(6)]
TOKENS_BEFORE_KILL = 8  # every stream has sent at least this many when D dies


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.set_num_threads(1)  # this process shares the cores with the cluster's
    return build_tiny_target(tmp_path_factory.mktemp("migrate") / "target")


@pytest.fixture(scope="module")
def cluster(target: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    spec = tiny_cluster_spec(target, tmp_path_factory.mktemp("logs"), num_decode=2)
    with Cluster(spec) as started:
        yield started


async def test_killed_decode_worker_requests_migrate_and_complete(
    cluster: Cluster, target: Path
) -> None:
    streams = await start_streams(
        cluster.router_address, PROMPTS, MAX_TOKENS, min_tokens=TOKENS_BEFORE_KILL
    )
    running = [(await worker_stats(d)).num_running for d in cluster.decode]
    victim = cluster.decode[0] if running[0] >= running[1] else cluster.decode[1]
    survivor = cluster.decode[1] if victim is cluster.decode[0] else cluster.decode[0]
    victim.process.send_signal(signal.SIGKILL)
    victim.process.wait(timeout=10)
    assert max(streams.counts) < MAX_TOKENS, "a stream ended before the kill: raise MAX_TOKENS"
    results = await streams.results(timeout_s=180)

    ours = [check_stream(chunks, MAX_TOKENS) for chunks in results]
    assert ours == engine_greedy(target, PROMPTS, MAX_TOKENS)
    assert router_counter(cluster, "tandem_migrations_total") >= 1

    # The dead worker's holdings go when its lease (1 s) expires; the rest is clean now.
    client = redis.Redis.from_url(cluster.redis_url, decode_responses=True)
    ledger = Ledger(client)
    try:
        deadline = asyncio.get_running_loop().time() + 10
        while ledger.holdings() and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.1)
        assert ledger.holdings() == []
        assert non_final_requests(ledger) == {}
        for component in (*cluster.prefill, survivor):
            stats = await worker_stats(component, include_block_ids=True)
            assert stats.num_kv_blocks_used == 0 and not stats.owned_block_ids, component.name
        assert (
            ledger.audit(
                {
                    c.name: set((await worker_stats(c, include_block_ids=True)).owned_block_ids)
                    for c in (*cluster.prefill, survivor)
                }
            )
            == []
        )
    finally:
        client.close()

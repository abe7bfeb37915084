"""Stalled workers (SIGSTOP, real processes): a decode worker frozen mid-stream answers no
keepalive ping, so the router gives up on it within 1.5 x --keepalive-ms and resumes its
streams on the other decode worker; the client sees one contiguous stream with the
in-process engine's greedy tokens. Resumed (SIGCONT), the worker finds its streams
cancelled and lets their blocks go: the audit is clean and it serves again. A prefill
worker frozen as requests arrive costs them a retry on the other one, not an error."""

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
    SERVICE_ARGS,
    build_tiny_target,
    check_stream,
    engine_greedy,
    generate_all,
    router_counter,
    start_streams,
    tiny_cluster_spec,
    wait_audit_clean,
    worker_stats,
)

pytestmark = pytest.mark.timeout(300)
KEEPALIVE_MS = 2000
MAX_TOKENS = 500  # long enough that every stream is mid-way when its worker stops
PROMPTS = [[(5 * i + 3 * j) % 61 + 3 for j in range(5 + 3 * i)] for i in range(6)]


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.set_num_threads(1)  # this process shares the cores with the cluster's
    return build_tiny_target(tmp_path_factory.mktemp("stalls") / "target")


@pytest.fixture(scope="module")
def cluster(target: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    spec = tiny_cluster_spec(
        target,
        tmp_path_factory.mktemp("stalls_logs"),
        num_prefill=2,
        num_decode=2,
        service_args=(*SERVICE_ARGS, "--keepalive-ms", str(KEEPALIVE_MS)),
    )
    with Cluster(spec) as started:
        yield started


async def audit_clean(cluster: Cluster) -> None:
    client = redis.Redis.from_url(cluster.redis_url, decode_responses=True)
    try:
        await wait_audit_clean(cluster, Ledger(client), within_s=15)
    finally:
        client.close()


async def test_a_frozen_decode_worker_streams_resume_elsewhere(
    cluster: Cluster, target: Path
) -> None:
    streams = await start_streams(cluster.router_address, PROMPTS, MAX_TOKENS, min_tokens=5)
    running = [(await worker_stats(d)).num_running for d in cluster.decode]
    frozen = cluster.decode[0] if running[0] >= running[1] else cluster.decode[1]
    frozen.process.send_signal(signal.SIGSTOP)
    try:
        assert max(streams.counts) < MAX_TOKENS, "a stream ended before the stop"
        results = await streams.results(timeout_s=120)
    finally:
        frozen.process.send_signal(signal.SIGCONT)
    ours = [check_stream(chunks, MAX_TOKENS) for chunks in results]
    assert ours == engine_greedy(target, PROMPTS, MAX_TOKENS)
    assert router_counter(cluster, "tandem_migrations_total") >= 1
    await audit_clean(cluster)
    # Both decode workers serve again (the frozen one registered anew).
    assert await generate_all(cluster.router_address, PROMPTS, 20) == engine_greedy(
        target, PROMPTS, 20
    )


async def test_requests_sent_to_a_frozen_prefill_worker_complete(
    cluster: Cluster, target: Path
) -> None:
    frozen = cluster.prefill[0]
    frozen.process.send_signal(signal.SIGSTOP)
    try:
        ours = await asyncio.wait_for(generate_all(cluster.router_address, PROMPTS, 20), 120)
    finally:
        frozen.process.send_signal(signal.SIGCONT)
    assert ours == engine_greedy(target, PROMPTS, 20)
    await audit_clean(cluster)

"""A router's health means "can serve now", and a request sent while its workers warm up
waits for them instead of failing: real router, prefill and decode processes (the tiny
target, fp32, eager), a real redis-server, loopback gRPC and HTTP.

One cluster, in order: the workers are stopped (lost: the router turns NOT_SERVING), the
router is started again with no worker (a router that has never had one, as at a cold
start or while workers compile), two requests (gRPC and HTTP) are sent and are seen
waiting in the router, then the workers start: both requests complete with the engine's
tokens, and health turns SERVING."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx2 as httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ledger.ledger import Ledger, WorkerRole
from ledger.redis_connect import connect
from router.routing import WORKER_WAIT_S
from serving.launcher import Cluster, Component
from tests.services.cluster_helpers import (
    build_tiny_target,
    check_stream,
    engine_greedy,
    run,
    tiny_cluster_spec,
)

PROMPT = [1, 20, 33, 41, 7, 9]
MAX_TOKENS = 12
SERVICE = "tandem.v1.Generation"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_target(tmp_path_factory.mktemp("warm_up_target"))


@pytest.fixture(scope="module")
def cluster(target: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    spec = tiny_cluster_spec(target, tmp_path_factory.mktemp("warm_up_logs"))
    with Cluster(spec) as started:
        yield started


async def health(address: str, service: str = "") -> str:
    """The router's grpc.health.v1 status for ``service`` ("": the server's overall)."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


async def http_health(cluster: Cluster) -> int:
    assert cluster.router is not None
    async with httpx.AsyncClient() as http:
        reply = await http.get(cluster.router.base_url.removesuffix("/v1") + "/health")
    return reply.status_code


async def wait_for(condition_s: float, check: object, what: str) -> None:
    """Polls the coroutine function ``check`` until it returns True (an event seen in
    another process: health, the ledger), at most ``condition_s`` seconds."""
    deadline = time.monotonic() + condition_s
    while not await check():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"not within {condition_s} s: {what}"
        await asyncio.sleep(0.1)


def stop(component: Component, sig: signal.Signals) -> None:
    component.process.send_signal(sig)
    component.process.wait(timeout=30)


def router_in_flight(cluster: Cluster) -> int:
    """The router's requests in flight, as its heartbeat last put them in the ledger."""
    assert cluster.redis_settings is not None
    client = connect(cluster.redis_settings, decode_responses=True)
    try:
        routers = [w for w in Ledger(client).list_workers() if w.role is WorkerRole.ROUTER]
    finally:
        client.close()
    return sum(int(w.stats.get("num_in_flight", 0)) for w in routers)


async def test_health_follows_the_workers_and_requests_wait_for_them(
    cluster: Cluster, target: Path
) -> None:
    assert cluster.router is not None
    address = cluster.router_address
    expected = engine_greedy(target, [PROMPT], MAX_TOKENS)[0]
    assert await health(address) == "SERVING" and await http_health(cluster) == 200

    # The decode worker lost (killed: its heartbeat stops, its registration expires): the
    # router turns NOT_SERVING, though its prefill worker lives; its service still says
    # the process works. Then the prefill worker goes too (drained).
    (prefill,), (decode,) = cluster.prefill, cluster.decode
    stop(decode, signal.SIGKILL)

    async def is_not_serving() -> bool:
        return await health(address) == "NOT_SERVING"

    await wait_for(10, is_not_serving, "NOT_SERVING once the decode worker is gone")
    assert await health(address, SERVICE) == "SERVING"  # liveness: the process is fine
    assert await http_health(cluster) == 503
    stop(prefill, signal.SIGTERM)

    # A router that has never had a worker (a cold start): NOT_SERVING from its first
    # answer, and requests wait for workers within their deadline.
    stop(cluster.router, signal.SIGTERM)
    cluster.restart(cluster.router)

    async def answers() -> bool:
        try:
            return await health(address, SERVICE) == "SERVING"
        except grpc.aio.AioRpcError:
            return False

    await wait_for(60, answers, "the restarted router answers")
    assert await health(address) == "NOT_SERVING" and await http_health(cluster) == 503

    by_grpc = asyncio.create_task(
        run(address, PROMPT, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    )

    async def by_http() -> httpx.Response:
        assert cluster.router is not None
        async with httpx.AsyncClient(timeout=120) as http:
            return await http.post(
                f"{cluster.router.base_url}/completions",
                json={
                    "model": target.name,
                    "prompt": PROMPT,
                    "max_tokens": MAX_TOKENS,
                    "temperature": 0,
                    "ignore_eos": True,
                },
            )

    http_task = asyncio.create_task(by_http())

    async def both_waiting() -> bool:
        assert not by_grpc.done() and not http_task.done(), "a request ended early"
        return await asyncio.to_thread(router_in_flight, cluster) == 2

    await wait_for(30, both_waiting, "both requests waiting in the router")
    # Longer than a request waits once the router has had workers: these wait on.
    await asyncio.sleep(WORKER_WAIT_S + 1)
    assert not by_grpc.done() and not http_task.done()
    assert await health(address) == "NOT_SERVING"

    cluster.restart(prefill)
    cluster.restart(decode)
    chunks = await asyncio.wait_for(by_grpc, timeout=120)
    reply = await asyncio.wait_for(http_task, timeout=120)
    assert check_stream(chunks, MAX_TOKENS) == expected
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["usage"]["completion_tokens"] == MAX_TOKENS
    assert body["choices"][0]["text"] == "".join(c.text for c in chunks)

    async def is_serving() -> bool:
        return await health(address) == "SERVING"

    await wait_for(10, is_serving, "SERVING once the workers are back")
    assert await http_health(cluster) == 200

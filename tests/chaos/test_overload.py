"""The router's bounds on a real tiny cluster whose decode worker has 600 KV blocks:
requests in flight (--max-in-flight 3) and requests waiting for KV room while every decode
worker is full (--max-waiting 1). Beyond either, RESOURCE_EXHAUSTED with a retry hint
(HTTP 429 with Retry-After); the waiting request and the streams in flight complete with
the in-process engine's tokens, and nothing is left held.

Blocks (4 tokens each): `long` peaks at 475 (1000-token prompt, 900 tokens out), `short`
at 110, and `big` needs 378 (a 1500-token prompt): it fits only once `long` is done."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx2 as httpx
import pytest
import redis
import torch

from engine.llm_engine import EngineConfig, LLMEngine
from ledger.ledger import Ledger
from serving.launcher import Cluster
from tandem.v1 import generation_pb2 as gen
from tandem_client import AsyncTandemClient, Overloaded
from tandem_client.client import agenerate
from tests.services.cluster_helpers import (
    assert_greedy_equal,
    build_tiny_target,
    check_stream,
    engine_greedy,
    metric,
    tiny_cluster_spec,
    until,
    wait_audit_clean,
)

pytestmark = pytest.mark.timeout(300)
NUM_DECODE_BLOCKS = 600
LONG = [3 + (5 * j) % 59 for j in range(1000)]
SHORT = [3 + (7 * j) % 53 for j in range(40)]
BIG = [3 + (11 * j) % 57 for j in range(1500)]
LONG_TOKENS, SHORT_TOKENS, BIG_TOKENS = 900, 400, 8
TOKENS = (LONG_TOKENS, SHORT_TOKENS, BIG_TOKENS)


def block_bytes(target: Path) -> int:
    """Bytes of one KV block at block size 4, fp32."""
    config = EngineConfig(model=str(target), dtype="float32", block_size=4, kv_cache_memory=1 << 22)
    return (1 << 22) // LLMEngine(config).block_manager.num_blocks


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.set_num_threads(1)
    return build_tiny_target(tmp_path_factory.mktemp("bounds") / "target")


@pytest.fixture(scope="module")
def cluster(target: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    spec = tiny_cluster_spec(
        target,
        tmp_path_factory.mktemp("bounds_logs"),
        router_args=("--max-in-flight", "3", "--max-waiting", "1"),
        decode_args=("--kv-cache-memory", str(NUM_DECODE_BLOCKS * block_bytes(target))),
    )
    with Cluster(spec) as cluster:
        yield cluster


def router_gauge(cluster: Cluster, name: str) -> float:
    """The router's tandem_requests_{in_flight,waiting} gauge."""
    assert cluster.router is not None
    return metric(cluster.router, f"tandem_requests_{name}", "router")


async def stream(
    address: str, prompt: list[int], max_tokens: int, started: asyncio.Event
) -> list[gen.GenerateChunk]:
    """A greedy stream; ``started`` is set at its first chunk."""
    chunks = []
    async with grpc.aio.insecure_channel(address) as channel:
        request = agenerate(
            channel, prompt, timeout=120, max_tokens=max_tokens, temperature=0.0, ignore_eos=True
        )
        async for chunk in request:
            chunks.append(chunk)
            started.set()
    return chunks


async def test_beyond_the_router_bounds_requests_are_refused_with_a_retry_hint(
    cluster: Cluster, target: Path
) -> None:
    assert cluster.router is not None
    address = cluster.router_address
    started = [asyncio.Event(), asyncio.Event(), asyncio.Event()]
    long = asyncio.create_task(stream(address, LONG, LONG_TOKENS, started[0]))
    short = asyncio.create_task(stream(address, SHORT, SHORT_TOKENS, started[1]))
    await asyncio.wait_for(asyncio.gather(started[0].wait(), started[1].wait()), timeout=60)
    big = asyncio.create_task(stream(address, BIG, BIG_TOKENS, started[2]))
    await until(lambda: router_gauge(cluster, "waiting") == 1, "big waits for KV room")

    # 3 in flight (long, short, big): one more is refused at once, over HTTP.
    async with httpx.AsyncClient(timeout=60) as http:
        reply = await http.post(
            f"{cluster.router.base_url}/completions",
            json={"model": "target", "prompt": [5, 6, 7], "max_tokens": 2},
        )
    assert reply.status_code == 429, reply.text
    assert "--max-in-flight" in reply.json()["error"]["message"]
    assert reply.headers["retry-after"] == "1"
    assert not short.done(), "short ended before the bound was tried: make it longer"

    await asyncio.wait_for(short, timeout=120)  # 2 in flight now
    await until(lambda: router_gauge(cluster, "in_flight") == 2, "short counted out")
    assert not started[2].is_set(), "big got room while long ran"
    # Admitted (2 < 3), but `big` already waits for room (1 of --max-waiting 1).
    async with AsyncTandemClient(address, timeout=60, max_retries=0) as client:
        with pytest.raises(Overloaded) as refused:
            await client.generate(BIG[::-1], max_tokens=2, temperature=0.0)
    assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "--max-waiting" in refused.value.message
    assert refused.value.retry_after_s == 1.0

    ours = [
        check_stream(await asyncio.wait_for(long, timeout=120), LONG_TOKENS),
        check_stream(short.result(), SHORT_TOKENS),
        check_stream(await asyncio.wait_for(big, timeout=120), BIG_TOKENS),
    ]
    prompts = [LONG, SHORT, BIG]
    refs = [engine_greedy(target, [p], n)[0] for p, n in zip(prompts, TOKENS, strict=True)]
    assert_greedy_equal(target, prompts, ours, refs)
    client = redis.Redis.from_url(cluster.redis_url, decode_responses=True)
    try:
        await wait_audit_clean(cluster, Ledger(client))
    finally:
        client.close()

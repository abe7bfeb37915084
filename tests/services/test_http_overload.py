"""The HTTP API under overload and while draining, on a real tiny cluster whose prefill
worker takes one prefill at a time (`--max-queued 1`): requests beyond it get 429 in
OpenAI's shape with a retry hint, the others complete, nothing is left held; a router told
to stop (SIGTERM) answers 503 to new requests and on /health while its streams finish."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Iterator

import grpc
import httpx2 as httpx
import pytest
import redis
import torch

from ledger.ledger import Ledger
from serving.launcher import Cluster
from tandem_client import AsyncTandemClient, Overloaded
from tests.services.cluster_helpers import build_tiny_target, tiny_cluster_spec, wait_audit_clean

pytestmark = pytest.mark.timeout(300)
MODEL = "target"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    torch.set_num_threads(1)
    target = build_tiny_target(tmp_path_factory.mktemp("overload") / MODEL)
    spec = tiny_cluster_spec(
        target, tmp_path_factory.mktemp("overload_logs"), port=0, prefill_args=("--max-queued", "1")
    )
    with Cluster(spec) as cluster:
        yield cluster


def body(**fields: object) -> dict[str, object]:
    return {"model": MODEL, "temperature": 0, "ignore_eos": True, **fields}


async def test_requests_beyond_the_prefill_queue_get_429(cluster: Cluster) -> None:
    assert cluster.router is not None
    url = f"{cluster.router.base_url}/completions"
    prompts = [[3 + (i * 7 + j) % 60 for j in range(1500)] for i in range(12)]
    async with httpx.AsyncClient(timeout=120) as http:
        replies = await asyncio.gather(
            *(http.post(url, json=body(prompt=p, max_tokens=4)) for p in prompts)
        )
    codes = sorted(r.status_code for r in replies)
    assert set(codes) == {200, 429}, codes
    for reply in replies:
        if reply.status_code == 429:
            error = reply.json()["error"]
            assert error["type"] == "rate_limit_error" and "retry later" in error["message"]
            assert reply.headers["retry-after"] == "1"
        else:
            assert reply.json()["usage"]["completion_tokens"] == 4
    client = redis.Redis.from_url(cluster.redis_url, decode_responses=True)
    try:
        await wait_audit_clean(cluster, Ledger(client))
    finally:
        client.close()


async def test_the_sdk_raises_overloaded_from_a_real_answer(cluster: Cluster) -> None:
    prompts = [[3 + (i * 5 + j) % 60 for j in range(1500)] for i in range(12)]
    async with AsyncTandemClient(cluster.router_address, timeout=120, max_retries=0) as client:
        answers = await asyncio.gather(
            *(client.generate(p, max_tokens=4, temperature=0.0) for p in prompts),
            return_exceptions=True,
        )
    refused = [a for a in answers if isinstance(a, BaseException)]
    assert refused and all(isinstance(a, Overloaded) for a in refused), refused
    assert refused[0].code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "retry later" in refused[0].message
    assert all(a.usage.completion_tokens == 4 for a in answers if not isinstance(a, BaseException))


async def test_a_draining_router_answers_503_while_its_streams_finish(cluster: Cluster) -> None:
    """Last in the module: it stops the router."""
    assert cluster.router is not None
    base = cluster.router.base_url
    stream_body = body(prompt="ab", max_tokens=600, stream=True)
    async with (
        httpx.AsyncClient(timeout=60) as http,
        http.stream("POST", f"{base}/completions", json=stream_body) as reply,
    ):
        lines = reply.aiter_lines()
        assert (await anext(lines)).startswith("data: ")
        cluster.router.process.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.5)  # the router heard it and drains
        health = await http.get(base.removesuffix("/v1") + "/health")
        refused = await http.post(f"{base}/completions", json=body(prompt="ab", max_tokens=2))
        rest = [line async for line in lines if line.startswith("data: ")]
    assert health.status_code == 503
    assert refused.status_code == 503 and "draining" in refused.json()["error"]["message"]
    assert rest[-1] == "data: [DONE]" and len(rest) > 2  # the stream in flight finished

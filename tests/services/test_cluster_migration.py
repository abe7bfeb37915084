"""A decode worker killed mid-stream (SIGKILL, real processes): the router takes its
requests back in the ledger and resumes them on the other decode worker (prompt + tokens
already sent, re-prefilled). The client sees no error, one contiguous stream, and the
same greedy tokens as the in-process engine; the dead worker's blocks are reclaimed by
the reaper when its lease expires, and nothing else is left held."""

from __future__ import annotations

import asyncio
import re
import signal
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import redis
import torch

from cluster.launcher import Cluster, ClusterSpec
from cluster.ledger import Ledger
from engine.llm_engine import EngineConfig, LLMEngine
from engine.sampling_params import SamplingParams
from router.client import agenerate
from tandem.v1 import generation_pb2 as gen
from tests.engine.tiny_models import build_tiny_llama
from tests.services.cluster_helpers import check_stream, non_final_requests, worker_stats
from tests.services.tiny_tokenizer import save_char_tokenizer

VOCAB = 64
MAX_TOKENS = 500  # long enough that every stream is mid-way when its worker is killed
PROMPTS = [[(5 * i + 3 * j) % 61 + 3 for j in range(5 + 3 * i)] for i in range(6)]
TOKENS_BEFORE_KILL = 8  # every stream has sent at least this many when D dies


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("migrate") / "target"
    build_tiny_llama(
        out,
        "gqa4_llama3rope_hd72_mlpbias",
        num_layers=2,
        vocab_size=VOCAB,
        max_position_embeddings=2048,
    )
    save_char_tokenizer(out, VOCAB)
    return out


@pytest.fixture(scope="module")
def cluster(target: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    spec = ClusterSpec(
        model=str(target),
        num_prefill=1,
        num_decode=2,
        port=0,
        worker_args=("--dtype", "float32", "--block-size", "4"),
        service_args=("--heartbeat-ms", "300", "--lease-ms", "1000", "--log-level", "WARNING"),
        log_dir=tmp_path_factory.mktemp("logs"),
        grace_s=5.0,
    )
    with Cluster(spec) as started:
        yield started


def in_process(target: Path) -> list[list[int]]:
    engine = LLMEngine(
        EngineConfig(
            model=str(target), dtype="float32", block_size=4, kv_cache_memory=8 << 20, num_threads=1
        )
    )
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(PROMPTS):
        engine.add_request(str(i), p, params)
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
    return [done[str(i)] for i in range(len(PROMPTS))]


def router_migrations(cluster: Cluster) -> float:
    assert cluster.router is not None
    with urllib.request.urlopen(cluster.router.metrics_url, timeout=5) as response:
        text = response.read().decode()
    found = re.search(r'^tandem_migrations_total\{role="router"\} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


async def test_killed_decode_worker_requests_migrate_and_complete(
    cluster: Cluster, target: Path
) -> None:
    counts = [0] * len(PROMPTS)
    all_started = asyncio.Event()

    async def stream(i: int) -> list[gen.GenerateChunk]:
        chunks = []
        async with grpc.aio.insecure_channel(cluster.router_address) as channel:
            request = agenerate(
                channel,
                PROMPTS[i],
                timeout=120,
                max_tokens=MAX_TOKENS,
                temperature=0.0,
                ignore_eos=True,
            )
            async for chunk in request:
                chunks.append(chunk)
                counts[i] += len(chunk.token_ids)
                if min(counts) >= TOKENS_BEFORE_KILL:
                    all_started.set()
        return chunks

    tasks = [asyncio.create_task(stream(i)) for i in range(len(PROMPTS))]
    await asyncio.wait_for(all_started.wait(), timeout=60)
    running = [(await worker_stats(d)).num_running for d in cluster.decode]
    victim = cluster.decode[0] if running[0] >= running[1] else cluster.decode[1]
    survivor = cluster.decode[1] if victim is cluster.decode[0] else cluster.decode[0]
    victim.process.send_signal(signal.SIGKILL)
    victim.process.wait(timeout=10)
    assert max(counts) < MAX_TOKENS, "a stream ended before the kill: raise MAX_TOKENS"
    results = await asyncio.wait_for(asyncio.gather(*tasks), timeout=180)

    ours = [check_stream(chunks, MAX_TOKENS) for chunks in results]
    assert ours == in_process(target)
    assert router_migrations(cluster) >= 1

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

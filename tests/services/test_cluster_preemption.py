"""A decode worker short of KV blocks, in a real cluster (tiny model with an EAGLE-3
draft): Reserve refuses when full and the router waits and retries; when blocks run out
mid-decode the worker preempts the newest request and hands it back, and the router
resumes it (prompt + tokens already sent) on a prefill and decode worker. The client sees
one contiguous stream; greedy and seeded sampled outputs equal the in-process engine's,
and nothing is left held."""

from __future__ import annotations

import asyncio
import re
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import torch

from engine.llm_engine import EngineConfig, LLMEngine
from engine.sampling_params import SamplingParams
from engine.spec.config import SpeculativeConfig
from ledger.ledger import Ledger
from serving.launcher import Cluster
from tests.engine.tiny_drafts import build_random_draft
from tests.engine.tiny_models import build_tiny_llama
from tests.services.cluster_helpers import (
    assert_audit_clean,
    check_stream,
    run,
    tiny_cluster_spec,
    worker_stats,
)
from tests.services.tiny_tokenizer import save_char_tokenizer

VOCAB = 64
K = 3
MAX_TOKENS = 40
NUM_DECODE_BLOCKS = 40  # a request ends up needing about 19 (prompt + 40 + lookahead)
PROMPTS = [[(7 * i + 3 * j) % 61 + 3 for j in range(6 + 2 * i)] for i in range(8)]


def params(i: int) -> dict[str, object]:
    if i % 3 == 1:  # seeded sampling resumes exactly too: random numbers keyed on position
        return {"max_tokens": MAX_TOKENS, "temperature": 0.9, "seed": 500 + i, "ignore_eos": True}
    return {"max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("preempt")
    build_tiny_llama(out / "target", "gqa4_llama3rope_hd72_mlpbias", num_layers=2, vocab_size=VOCAB)
    build_random_draft(out / "target", out / "eagle3", "eagle3", seed=1, std=0.3)
    save_char_tokenizer(out / "target", VOCAB)
    return out / "target", out / "eagle3"


def block_bytes(target: Path, draft: Path) -> int:
    """Bytes of one block id (target and draft KV together) at block size 4, fp32."""
    config = EngineConfig(
        model=str(target),
        dtype="float32",
        block_size=4,
        kv_cache_memory=1 << 22,
        speculative=SpeculativeConfig(str(draft), num_draft_tokens=K),
    )
    return (1 << 22) // LLMEngine(config).block_manager.num_blocks


@pytest.fixture(scope="module")
def cluster(dirs: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    target, draft = dirs
    spec = tiny_cluster_spec(
        target,
        tmp_path_factory.mktemp("logs"),
        draft=str(draft),
        num_draft_tokens=K,
        adaptive_speculation=False,  # K every step: counters as one engine's
        decode_args=("--kv-cache-memory", str(NUM_DECODE_BLOCKS * block_bytes(target, draft))),
    )
    with Cluster(spec) as started:
        yield started


def in_process(target: Path, draft: Path) -> list[list[int]]:
    """One roomy engine doing everything."""
    config = EngineConfig(
        model=str(target),
        dtype="float32",
        block_size=4,
        kv_cache_memory=8 << 20,
        num_threads=1,
        speculative=SpeculativeConfig(str(draft), num_draft_tokens=K),
    )
    engine = LLMEngine(config)
    for i, p in enumerate(PROMPTS):
        engine.add_request(str(i), p, SamplingParams(**params(i)))  # type: ignore[arg-type]
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
    return [done[str(i)] for i in range(len(PROMPTS))]


def preemptions(cluster: Cluster) -> float:
    with urllib.request.urlopen(cluster.decode[0].metrics_url, timeout=5) as response:
        text = response.read().decode()
    pattern = r'^tandem_requests_total\{role="decode",status="preempted"\} (\S+)$'
    found = re.search(pattern, text, re.M)
    return float(found.group(1)) if found else 0.0


async def test_preempted_requests_resume_and_equal_the_engine(
    cluster: Cluster, dirs: tuple[Path, Path]
) -> None:
    stats = await worker_stats(cluster.decode[0])
    assert stats.num_kv_blocks_free == NUM_DECODE_BLOCKS
    results = await asyncio.gather(
        *(run(cluster.router_address, p, **params(i)) for i, p in enumerate(PROMPTS))
    )
    ours = [check_stream(chunks, MAX_TOKENS) for chunks in results]
    assert preemptions(cluster) > 0, "the decode worker was meant to run out of blocks"
    assert ours == in_process(*dirs)
    # Each request's usage counts the drafts of every attempt, the preempted ones too:
    # together, exactly what the decode worker counted.
    counted = (await worker_stats(cluster.decode[0])).speculative
    for field in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        per_request = [getattr(chunks[-1].usage.speculative, field) for chunks in results]
        assert sum(per_request) == getattr(counted, field) - getattr(stats.speculative, field)
    client = redis.Redis.from_url(cluster.redis_url, decode_responses=True)
    try:
        await assert_audit_clean(cluster, Ledger(client))
    finally:
        client.close()

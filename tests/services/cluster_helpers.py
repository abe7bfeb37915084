"""What the cluster tests share: a tiny target model and its in-process greedy output, a
cluster spec for it, streaming requests through the router (also several at once, to act
mid-stream), checking a stream's chunks, asking workers for their stats and blocks in use,
waiting for a request's blocks to come free, reading a component's metrics, the audit of
a live cluster and the end-of-test audit."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from transformers import LlamaForCausalLM

from engine.llm_engine import EngineConfig, LLMEngine
from engine.sampling_params import SamplingParams
from engine.spec.config import SpeculativeConfig
from ledger.audit import AllocatorReport, Discrepancy, seen_in_every_look
from ledger.ledger import Ledger, RequestState
from serving.launcher import Cluster, ClusterSpec, Component
from tandem.v1 import generation_pb2 as gen
from tandem.v1 import worker_pb2 as pb
from tandem.v1 import worker_pb2_grpc as pb_grpc
from tandem_client.client import agenerate
from tests.comparator import compare_greedy
from tests.engine.tiny_models import build_tiny_llama
from tests.services.tiny_tokenizer import save_char_tokenizer

TINY_VOCAB = 64
# fp32 and small blocks, as the in-process engine the output is compared with
TINY_WORKER_ARGS = ("--dtype", "float32", "--block-size", "4")
# Heartbeats and leases short enough that a test sees deaths and expiries within a second.
SERVICE_ARGS = ("--heartbeat-ms", "300", "--lease-ms", "1000", "--log-level", "WARNING")


def build_tiny_target(out: Path) -> Path:
    """A 2-layer random Llama (GQA, Llama-3 RoPE, MLP bias) with a character tokenizer,
    positions up to 2048 so that long streams fit."""
    build_tiny_llama(
        out,
        "gqa4_llama3rope_hd72_mlpbias",
        num_layers=2,
        vocab_size=TINY_VOCAB,
        max_position_embeddings=2048,
    )
    save_char_tokenizer(out, TINY_VOCAB)
    return out


def tiny_cluster_spec(target: Path, log_dir: Path, **fields: Any) -> ClusterSpec:
    """A cluster serving the tiny target, 1 prefill + 1 decode worker and an embedded
    Redis unless ``fields`` (any of ``ClusterSpec``'s) say otherwise. Eager: compiling
    would add minutes to each module's start (compiled workers are tested on SmolLM2, in
    tests/services/test_cluster_smollm2.py)."""
    values: dict[str, Any] = dict(
        model=str(target),
        port=0,
        eager=True,
        worker_args=TINY_WORKER_ARGS,
        service_args=SERVICE_ARGS,
        log_dir=log_dir,
        grace_s=5.0,
    )
    values.update(fields)
    return ClusterSpec(**values)


def assert_greedy_equal(
    target: Path, token_prompts: list[list[int]], ours: list[list[int]], refs: list[list[int]]
) -> None:
    """``ours`` equals ``refs`` up to at most one tie (CONVENTIONS.md), judged by
    transformers in fp32: a cluster batches rows differently from the in-process engine,
    which can flip a near-tie over a long greedy stream."""
    hf = LlamaForCausalLM.from_pretrained(str(target), dtype="float32").eval()
    result = compare_greedy(hf, token_prompts, ours, refs)
    assert result.num_ties <= 1, result


def engine_greedy(target: Path, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy output of the in-process engine (fp32, block size 4, EOS ignored), per prompt."""
    return greedy_engine(target, prompts, max_tokens)[0]


def greedy_engine(
    target: Path,
    prompts: list[list[int]],
    max_tokens: int,
    speculative: SpeculativeConfig | None = None,
) -> tuple[list[list[int]], LLMEngine]:
    """``engine_greedy``'s output (with ``speculative``'s drafts where given), and the
    engine that made it (its counters)."""
    config = EngineConfig(
        model=str(target),
        dtype="float32",
        block_size=4,
        kv_cache_memory=8 << 20,
        num_threads=1,  # the cores are shared with the cluster (CONVENTIONS.md)
        speculative=speculative,
    )
    engine = LLMEngine(config)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
    return [done[str(i)] for i in range(len(prompts))], engine


def router_counter(cluster: Cluster, name: str) -> float:
    """A counter of the router's /metrics (``tandem_migrations_total``...); 0 if absent."""
    assert cluster.router is not None
    return metric(cluster.router, name, "router")


def metric(component: Component, name: str, role: str) -> float:
    """A figure of ``component``'s /metrics with only the role label (a counter, or a
    histogram's ``_count``...); 0 if absent."""
    with urllib.request.urlopen(component.metrics_url, timeout=5) as response:
        text = response.read().decode()
    found = re.search(rf'^{name}\{{role="{role}"\}} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


async def until(condition: Callable[[], bool], what: str, within_s: float = 30.0) -> None:
    """Waits for ``condition`` (state another process changes: a metric, a ledger record),
    looking every 20 ms (a look that cannot connect counts as not yet); fails naming
    ``what`` after ``within_s``."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            if await asyncio.to_thread(condition):
                return
        except OSError:  # the metrics endpoint not reachable yet
            pass
        assert time.monotonic() < deadline, f"not within {within_s} s: {what}"
        await asyncio.sleep(0.02)


async def audit_command(cluster: Cluster, cwd: Path) -> subprocess.CompletedProcess[str]:
    """`tandem ledger audit` on the cluster, as a command (in a thread): it asks every
    registered worker itself."""
    command = [sys.executable, "-m", "tandem_client", "ledger", "audit"]
    command += ["--redis-url", cluster.redis_url]
    # Not from the checkout: a stale in-tree *.egg-info there would hide new entry points.
    return await asyncio.to_thread(
        subprocess.run, command, capture_output=True, text=True, timeout=60, cwd=cwd
    )


async def run(address: str, prompt: list[int] | str, **params: object) -> list[gen.GenerateChunk]:
    async with grpc.aio.insecure_channel(address) as channel:
        return [chunk async for chunk in agenerate(channel, prompt, timeout=120, **params)]


@dataclass
class Streams:
    """Greedy streams through the router, running, and what each has received so far."""

    tasks: list[asyncio.Task[list[gen.GenerateChunk]]]
    counts: list[int]  # tokens received per stream
    request_ids: list[str]  # each stream's request id, from its first chunk

    async def results(self, timeout_s: float = 120) -> list[list[gen.GenerateChunk]]:
        return await asyncio.wait_for(asyncio.gather(*self.tasks), timeout=timeout_s)


async def start_streams(
    address: str, prompts: list[list[int]], max_tokens: int, *, min_tokens: int
) -> Streams:
    """A greedy stream per prompt, all at once; returns once every one has received at
    least ``min_tokens`` tokens: the moment a test kills something mid-stream."""
    streams = Streams([], [0] * len(prompts), [""] * len(prompts))
    all_started = asyncio.Event()

    async def stream(i: int) -> list[gen.GenerateChunk]:
        chunks = []
        async with grpc.aio.insecure_channel(address) as channel:
            request = agenerate(
                channel,
                prompts[i],
                timeout=120,
                max_tokens=max_tokens,
                temperature=0.0,
                ignore_eos=True,
            )
            async for chunk in request:
                chunks.append(chunk)
                streams.request_ids[i] = chunk.request_id
                streams.counts[i] += len(chunk.token_ids)
                if min(streams.counts) >= min_tokens:
                    all_started.set()
        return chunks

    streams.tasks = [asyncio.create_task(stream(i)) for i in range(len(prompts))]
    await asyncio.wait_for(all_started.wait(), timeout=60)
    return streams


def tokens(chunks: list[gen.GenerateChunk]) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


def check_stream(chunks: list[gen.GenerateChunk], max_tokens: int) -> list[int]:
    """Indices contiguous from 0, one last chunk with finish_reason and usage."""
    index = 0
    for chunk in chunks:
        assert chunk.index == index, f"chunk index {chunk.index}, expected {index}"
        index += len(chunk.token_ids)
    assert [c.finish_reason != gen.FINISH_REASON_UNSPECIFIED for c in chunks][-1]
    assert all(c.finish_reason == gen.FINISH_REASON_UNSPECIFIED for c in chunks[:-1])
    last = chunks[-1]
    assert last.usage.completion_tokens == index <= max_tokens
    if last.finish_reason == gen.FINISH_REASON_LENGTH:
        assert index == max_tokens
    return tokens(chunks)


async def generate_all(
    address: str, token_prompts: list[list[int]], max_tokens: int
) -> list[list[int]]:
    """Greedy, all prompts at once (concurrent streams)."""
    results = await asyncio.gather(
        *(
            run(address, p, max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            for p in token_prompts
        )
    )
    return [check_stream(chunks, max_tokens) for chunks in results]


async def worker_stats(component: Component, *, include_block_ids: bool = False) -> pb.StatsReply:
    async with grpc.aio.insecure_channel(component.address) as channel:
        if component.name.startswith("prefill"):
            stub: Any = pb_grpc.PrefillWorkerStub(channel)
        else:
            stub = pb_grpc.DecodeWorkerStub(channel)
        request = pb.StatsRequest(include_block_ids=include_block_ids)
        reply: pb.StatsReply = await stub.Stats(request, timeout=5)
        return reply


def non_final_requests(ledger: Ledger) -> dict[str, str]:
    found = {}
    for key in ledger.client.scan_iter(match=f"{ledger.ns}:{{req:*}}", count=1000):
        if re.fullmatch(rf"{ledger.ns}:\{{req:[^}}]+\}}", key):
            state = ledger.client.hget(key, "state")
            if state is not None and not RequestState(state).is_terminal:
                found[key] = state
    return found


async def assert_audit_clean(cluster: Cluster, ledger: Ledger) -> None:
    """Every request ended: no worker holds a block for a request, the ledger agrees, no
    request is left in a non-final state, no component crashed."""
    reports = {}
    for component in (*cluster.prefill, *cluster.decode):
        stats = await worker_stats(component, include_block_ids=True)
        held = (stats.num_kv_blocks_used, list(stats.owned_block_ids))
        assert held == (0, []), f"{component.name} holds (blocks used, block ids) {held}"
        reports[component.name] = set(stats.owned_block_ids)
    assert ledger.audit(reports) == []
    assert ledger.holdings() == []
    assert non_final_requests(ledger) == {}
    crashed = [c.name for c in cluster.dead_components() if c.process.returncode != 0]
    assert not crashed, f"died: {crashed}"  # a drained component exits 0


async def audit_live(cluster: Cluster, ledger: Ledger, num_looks: int = 3) -> list[Discrepancy]:
    """The ledger against the workers' allocators while requests run, as `tandem ledger
    audit` does it: what every look, 0.2 s apart, found (a clean look ends it)."""
    looks: list[list[Discrepancy]] = []
    while True:
        reports: dict[str, AllocatorReport] = {}
        for component in (*cluster.prefill, *cluster.decode):
            stats = await worker_stats(component, include_block_ids=True)
            owned, counts = stats.owned_block_ids, stats.owned_block_ref_counts
            assert len(counts) == len(owned) and min(counts, default=1) >= 1, component.name
            reports[component.name] = AllocatorReport.counted(owned, counts)
        looks.append(ledger.audit(reports))
        found = seen_in_every_look(looks)
        if not found or len(looks) == num_looks:
            return found
        await asyncio.sleep(0.2)


async def wait_audit_clean(cluster: Cluster, ledger: Ledger, within_s: float = 3.0) -> None:
    """``assert_audit_clean``, allowing ``within_s`` for cleanups still under way (a
    cancelled request's aborts and ledger transition run after its stream ended)."""
    deadline = asyncio.get_running_loop().time() + within_s
    while True:
        try:
            await assert_audit_clean(cluster, ledger)
            return
        except AssertionError:
            if asyncio.get_running_loop().time() > deadline:
                raise
        await asyncio.sleep(0.05)


async def blocks_in_use(cluster: Cluster) -> tuple[int, int]:
    """KV blocks in use on the first prefill and the first decode worker."""
    p = await worker_stats(cluster.prefill[0])
    d = await worker_stats(cluster.decode[0])
    return p.num_kv_blocks_used, d.num_kv_blocks_used


async def wait_until_freed(
    cluster: Cluster, ledger: Ledger, request_id: str, within_s: float
) -> float:
    """Seconds until the request's blocks are free on P and D, it holds none in the ledger
    and its record has ended. The router ends the record after P and D acknowledge the
    abort, so the blocks come free a moment before the record changes."""
    start = time.monotonic()
    while True:
        held = [h for h in ledger.holdings() if h.request_id == request_id]
        record = ledger.get_request(request_id)
        ended = record is not None and record.state.is_terminal
        if await blocks_in_use(cluster) == (0, 0) and not held and ended:
            return time.monotonic() - start
        assert time.monotonic() - start < within_s, (await blocks_in_use(cluster), held, record)
        await asyncio.sleep(0.02)


def shm_rings(cluster: Cluster) -> list[str]:
    """The shared-memory rings the prefill worker keeps for reuse after its pushes (memfds
    it holds open)."""
    fds = Path(f"/proc/{cluster.prefill[0].process.pid}/fd")
    links = [os.readlink(fd) for fd in fds.iterdir()]
    return [link for link in links if link.startswith("/memfd:tandem-kv-ring")]

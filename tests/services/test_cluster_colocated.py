"""`tandem serve --colocate --tensor-parallel-size 2` on a tiny random model: a router and
one co-located worker (`python -m colocated_worker`: a prefill and a decode worker in one
process over one engine, routed to as a pair, the KV computed into the reserved blocks and
handed over in process) whose model is split over two ranks (the worker's process is rank
0, rank 1 a process it started), a real redis-server, loopback gRPC. Greedy output, the
draft's counters, logprobs and prompt logprobs equal the in-process engine's; requests
preempted for lack of KV blocks come back to the same worker and resume exactly;
cancelling frees every block; the ledger ends clean. A rank killed mid-stream takes its
worker down at once; the supervisor starts it again, ranks and all, and its streams
complete."""

from __future__ import annotations

import asyncio
import random
import re
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import psutil
import pytest
import redis
import torch

from engine.llm_engine import EngineConfig, LLMEngine
from engine.sampling_params import SamplingParams
from engine.spec.config import SpeculativeConfig
from ledger.ledger import Ledger, WorkerRole
from serving.launcher import Cluster
from tandem.v1 import worker_pb2 as pb
from tandem.v1 import worker_pb2_grpc as pb_grpc
from tests.engine.tiny_drafts import build_random_draft
from tests.engine.tiny_models import build_tiny_llama
from tests.services.cluster_helpers import (
    TINY_VOCAB,
    TINY_WORKER_ARGS,
    assert_greedy_equal,
    check_stream,
    engine_greedy,
    run,
    start_streams,
    tiny_cluster_spec,
    wait_audit_clean,
    worker_stats,
)
from tests.services.tiny_tokenizer import save_char_tokenizer

K = 3
NUM_BLOCKS = 128  # of 4 tokens: 8 streams of 120 tokens need about twice as many


def prompts(n: int, seed: int, max_len: int = 24) -> list[list[int]]:
    rng = random.Random(seed)
    return [
        [rng.randrange(3, TINY_VOCAB) for _ in range(rng.randint(1, max_len))] for _ in range(n)
    ]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    torch.set_num_threads(1)  # this process shares the cores with the cluster's
    out = tmp_path_factory.mktemp("cluster_colocated")
    target = out / "target"
    build_tiny_llama(target, "gqa4_llama3rope_hd72_mlpbias", num_layers=2, vocab_size=TINY_VOCAB)
    # As test_cluster_tiny's: a seed and scale with which some drafts are accepted.
    build_random_draft(target, out / "eagle3", "eagle3", seed=1, std=0.3)
    save_char_tokenizer(target, TINY_VOCAB)
    return target, out / "eagle3"


def reference_engine(target: Path, draft: Path, num_blocks: int = 512) -> LLMEngine:
    config = EngineConfig(
        model=str(target),
        dtype="float32",
        block_size=4,
        kv_cache_memory=1 << 30,
        num_threads=1,
        speculative=SpeculativeConfig(str(draft), num_draft_tokens=K),
    )
    engine = LLMEngine(config)
    assert engine.block_manager.num_blocks >= num_blocks
    return engine


@pytest.fixture(scope="module")
def cluster(
    model_dirs: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    target, draft = model_dirs
    # The worker's cache: NUM_BLOCKS blocks, sized from rank 0's bytes per block (it holds
    # the draft's KV and half the target's: one of its two KV heads); rank 1 holds more.
    engine = reference_engine(target, draft)
    assert engine.spec is not None and engine.spec.draft_kv is not None
    block_bytes = engine.kv_cache.params.bytes_per_block // 2
    block_bytes += engine.spec.draft_kv.params.bytes_per_block
    spec = tiny_cluster_spec(
        target,
        tmp_path_factory.mktemp("logs_colocated"),
        draft=str(draft),
        num_draft_tokens=K,
        adaptive_speculation=False,  # K every step: counters as one engine's
        num_prefill=0,
        colocate=True,
        worker_args=(
            *TINY_WORKER_ARGS,
            *("--kv-cache-memory", str(NUM_BLOCKS * block_bytes)),
            *("--tensor-parallel-size", "2"),
        ),
    )
    started = Cluster(spec).start(timeout_s=120)
    try:
        yield started
    finally:
        started.stop()


@pytest.fixture(scope="module")
def ledger(cluster: Cluster) -> Iterator[Ledger]:
    client = redis.Redis.from_url(cluster.redis_url, decode_responses=True)
    yield Ledger(client)
    client.close()


@pytest.fixture(autouse=True)
async def audit_after_each_test(cluster: Cluster, ledger: Ledger) -> AsyncIterator[None]:
    yield
    await wait_audit_clean(cluster, ledger)


async def test_greedy_with_draft_and_logprobs_equal_the_engine(
    cluster: Cluster, ledger: Ledger, model_dirs: tuple[Path, Path]
) -> None:
    """Runs first: the worker's draft counters are this test's alone. One worker,
    registered as a co-located decode worker, serves everything."""
    target, draft = model_dirs
    assert cluster.prefill == [] and len(cluster.decode) == 1
    (worker,) = ledger.list_workers(WorkerRole.DECODE)
    assert worker.stats["prefills_in_place"] == "1"
    # Its model is split: rank 1 runs in a process of the worker's own.
    children = psutil.Process(cluster.decode[0].process.pid).children()
    ranks = [c for c in children if "engine.rank" in c.cmdline()]
    assert len(ranks) == 1 and "--rank" in ranks[0].cmdline()
    assert ledger.list_workers(WorkerRole.PREFILL) == []

    token_prompts = prompts(8, seed=1)  # test_cluster_tiny's: some drafts are accepted
    params = dict(max_tokens=20, temperature=0.0, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    results = await asyncio.gather(
        *(run(cluster.router_address, p, **params) for p in token_prompts)
    )
    engine = reference_engine(target, draft)
    for i, p in enumerate(token_prompts):
        engine.add_request(str(i), p, SamplingParams(**params))  # type: ignore[arg-type]
    expected = {}
    while engine.has_unfinished_requests():
        expected.update({out.request_id: out for out in engine.step() if out.finished})
    for i, (p, chunks) in enumerate(zip(token_prompts, results, strict=True)):
        ref = expected[str(i)]
        assert check_stream(chunks, 20) == ref.token_ids
        got = [lp for c in chunks for lp in c.logprobs]
        assert [lp.token_id for lp in got] == ref.token_ids
        assert [lp.logprob for lp in got] == pytest.approx(
            [lp.logprob for lp in ref.logprobs], abs=1e-4
        )
        assert [len(lp.top) for lp in got] == [2] * 20
        prompt_lps = [lp for c in chunks for lp in c.prompt_logprobs]
        assert ref.prompt_logprobs is not None
        assert [lp.token_id for lp in prompt_lps] == p[1:]
        assert [lp.logprob for lp in prompt_lps] == pytest.approx(
            [lp.logprob for lp in ref.prompt_logprobs], abs=1e-4
        )
        assert chunks[-1].usage.prompt_tokens == len(p)
    assert engine.spec is not None and engine.spec.stats.num_accepted_tokens > 0
    stats = (await worker_stats(cluster.decode[0])).speculative
    assert (stats.num_draft_tokens, stats.num_accepted_tokens) == (
        engine.spec.stats.num_draft_tokens,
        engine.spec.stats.num_accepted_tokens,
    )


async def test_preempted_requests_resume_on_the_same_worker_exactly(
    cluster: Cluster, model_dirs: tuple[Path, Path]
) -> None:
    """8 streams of up to 120 tokens need about twice the worker's blocks: the newest are
    handed back to the router and resumed there (prompt + tokens sent), greedy output
    unchanged."""
    target, draft = model_dirs
    token_prompts = prompts(8, seed=2, max_len=20)
    results = await asyncio.gather(
        *(
            run(cluster.router_address, p, max_tokens=100, temperature=0.0, ignore_eos=True)
            for p in token_prompts
        )
    )
    ours = [check_stream(chunks, 100) for chunks in results]
    preempted = re.search(
        r'^tandem_requests_total\{role="decode",status="preempted"\} (\S+)$',
        _metrics_text(cluster),
        re.M,
    )
    assert preempted and float(preempted.group(1)) > 0, "the cache was meant to run out"
    engine = reference_engine(target, draft)
    params = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(token_prompts):
        engine.add_request(str(i), p, params)
    expected = {}
    while engine.has_unfinished_requests():
        expected.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    assert ours == [expected[str(i)] for i in range(len(token_prompts))]


async def test_a_repeated_prompt_reuses_the_cached_blocks(cluster: Cluster) -> None:
    (prompt,) = prompts(1, seed=4, max_len=2)
    prompt = prompt * 9  # 18 or more tokens: 4 full blocks before the last token
    first = await run(cluster.router_address, prompt, max_tokens=2, temperature=0.0)
    again = await run(cluster.router_address, prompt, max_tokens=2, temperature=0.0)
    assert first[-1].usage.cached_tokens == 0
    assert again[-1].usage.cached_tokens == (len(prompt) - 1) // 4 * 4
    assert [t for c in again for t in c.token_ids] == [t for c in first for t in c.token_ids]


async def test_cancelled_streams_free_their_blocks(cluster: Cluster) -> None:
    """Streams cancelled mid-decode: the audit after the test finds nothing held."""
    streams = await start_streams(
        cluster.router_address, prompts(3, seed=3, max_len=8), 120, min_tokens=3
    )
    for task in streams.tasks:
        task.cancel()
    await asyncio.gather(*streams.tasks, return_exceptions=True)
    assert min(streams.counts) >= 3


def _metrics_text(cluster: Cluster) -> str:
    with urllib.request.urlopen(cluster.decode[0].metrics_url, timeout=5) as response:
        return str(response.read().decode())


async def test_its_prefill_side_serves_only_its_own_decode_side(
    cluster: Cluster, ledger: Ledger
) -> None:
    """The worker serves tandem.v1.PrefillWorker beside its DecodeWorker, for requests its
    decode side reserved: a Prefill naming another decode worker is refused, naming the
    field, and one with no reservation here fails as a push would (nothing held after)."""
    (worker,) = ledger.list_workers(WorkerRole.DECODE)
    async with grpc.aio.insecure_channel(cluster.decode[0].address) as channel:
        stub = pb_grpc.PrefillWorkerStub(channel)
        elsewhere = pb.PrefillRequest(
            request_id="p-elsewhere", prompt_token_ids=[5, 6, 7], decode_worker_id="decode-9"
        )
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Prefill(elsewhere, timeout=10)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "decode_worker_id: 'decode-9'" in (info.value.details() or "")
        unreserved = pb.PrefillRequest(
            request_id="p-unreserved",
            prompt_token_ids=[5, 6, 7],
            decode_worker_id=worker.worker_id,
            decode_epoch=worker.epoch,
        )
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Prefill(unreserved, timeout=10)
        assert "has no reservation here" in (info.value.details() or "")
    assert (await worker_stats(cluster.decode[0])).num_kv_blocks_used == 0


FAULT_TOKENS = 200  # long enough that every stream is mid-way when the rank is killed
FAULT_PROMPTS = [[(7 * i + 5 * j) % 61 + 3 for j in range(4 + 5 * i)] for i in range(3)]


def rank_processes(worker_pid: int) -> list[psutil.Process]:
    """The worker's other tensor-parallel ranks: processes it started."""
    children = psutil.Process(worker_pid).children()
    return [c for c in children if "engine.rank" in c.cmdline()]


def has_ended(process: psutil.Process) -> bool:
    try:
        return process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.last
async def test_a_killed_rank_takes_its_worker_down_and_it_comes_back_whole(
    cluster: Cluster, ledger: Ledger, model_dirs: tuple[Path, Path]
) -> None:
    """Rank 1 SIGKILLed mid-stream: the worker exits at once (code 3), the supervisor
    starts it again with both its ranks, and the streams it carried resume there and
    complete with the target's greedy tokens; no process of the old worker is left."""
    from tests.chaos.test_cluster_supervisor import supervising

    target, _ = model_dirs
    worker = cluster.decode[0]
    old_pid = worker.process.pid
    (old_rank,) = rank_processes(old_pid)
    with supervising(cluster) as lines:
        streams = await start_streams(
            cluster.router_address, FAULT_PROMPTS, FAULT_TOKENS, min_tokens=8
        )
        old_rank.kill()
        assert max(streams.counts) < FAULT_TOKENS, "a stream ended before the kill"
        results = await streams.results()
        assert any("colocated-0 died (exit code 3); restarting it" in line for line in lines)
        assert worker.process.pid != old_pid and worker.num_restarts == 1
    ours = [check_stream(chunks, FAULT_TOKENS) for chunks in results]
    assert_greedy_equal(
        target, FAULT_PROMPTS, ours, engine_greedy(target, FAULT_PROMPTS, FAULT_TOKENS)
    )
    assert not psutil.pid_exists(old_pid)
    # No rank the old worker started is left; the new worker has its own rank 1.
    assert [p.pid for p in started_by(old_pid)] == []
    assert len(rank_processes(worker.process.pid)) == 1


def started_by(worker_pid: int) -> list[psutil.Process]:
    """Live ranks whose rank 0 was ``worker_pid`` (orphans, if any, are no one's children)."""
    found = []
    for process in psutil.process_iter(["cmdline"]):
        cmdline = process.info["cmdline"] or []
        at = cmdline.index("--parent-pid") + 1 if "--parent-pid" in cmdline else 0
        if at and cmdline[at] == str(worker_pid) and not has_ended(process):
            found.append(process)
    return found

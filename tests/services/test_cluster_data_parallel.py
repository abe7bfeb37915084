"""DeepSeek-V3 served with data-parallel attention (issue 39), the experts split over the
ranks (`--data-parallel-size 2 --enable-expert-parallel`), the MLA EAGLE-3 draft on:
a prefill worker of one rank pushing into a decode worker of two, one of two ranks
pushing into a decode worker of one, a prefill worker split two ways by heads
(tensor-parallel) pushing into a decode worker of two data-parallel ranks, and a prefill
worker of one rank pushing into a decode worker of two data-parallel ranks of two
tensor-parallel ranks each (four ranks, a pair's shared pool written by both). Each request
lands on one decode rank: its reservation's blocks are that rank's, numbered as the
worker's shared pool of every rank's blocks, and so are its ledger holdings; a prefill
worker's ranks push their rows' KV from that pool. Greedy output and the draft counters
equal the offline engine's in the decode worker's layout; requests spread over both
decode ranks; the ledger agrees with the worker while they run and is clean after."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest
import redis

from engine.llm_engine import EngineConfig, LLMEngine
from engine.sampling_params import SamplingParams
from engine.spec.config import SpeculativeConfig
from ledger.ledger import Ledger, RequestState, WorkerRole
from serving.launcher import Cluster
from tandem.v1 import worker_pb2 as pb
from tandem.v1 import worker_pb2_grpc as pb_grpc
from tests.services.cluster_helpers import (
    TINY_VOCAB,
    audit_live,
    generate_all,
    start_streams,
    tiny_cluster_spec,
    tokens,
    wait_audit_clean,
    worker_stats,
)
from tests.services.test_cluster_deepseek_v3 import BLOCK_SIZE, MAX_TOKENS, PROMPTS, K
from tests.services.test_cluster_deepseek_v3 import model_dirs as model_dirs  # the fixture

KV_CACHE = 4 << 20
PLACEMENT = ["--enable-expert-parallel"]


DP2 = ("--data-parallel-size", "2")
TP2 = ("--tensor-parallel-size", "2")
# The prefill worker's flags, the decode worker's
LAYOUTS = {
    "prefill1_decode_dp2": ((), DP2),
    "prefill_dp2_decode1": (DP2, ()),
    "prefill_tp2_decode_dp2": (TP2, DP2),
    "prefill1_decode_dp2_tp2": ((), (*DP2, *TP2)),  # two data-parallel ranks of two
}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def layout(request: pytest.FixtureRequest) -> tuple[tuple[str, ...], tuple[str, ...]]:
    return LAYOUTS[request.param]


def decode_ranks(layout: tuple[tuple[str, ...], tuple[str, ...]]) -> int:
    """The decode worker's data-parallel ranks."""
    return 2 if layout[1][:2] == DP2 else 1


def decode_tensor_parallel(layout: tuple[tuple[str, ...], tuple[str, ...]]) -> int:
    """The decode worker's tensor-parallel ranks (inside each data-parallel rank)."""
    return 2 if layout[1][-2:] == TP2 else 1


@pytest.fixture(scope="module")
def cluster(
    model_dirs: dict[str, Path],
    tmp_path_factory: pytest.TempPathFactory,
    layout: tuple[tuple[str, ...], tuple[str, ...]],
) -> Iterator[Cluster]:
    spec = tiny_cluster_spec(
        model_dirs["target"],
        tmp_path_factory.mktemp("logs_dp"),
        draft=str(model_dirs["mla"]),
        num_draft_tokens=K,
        adaptive_speculation=False,  # K every step: counters as one engine's
        worker_args=(
            *("--dtype", "float32", "--block-size", str(BLOCK_SIZE)),
            *("--kv-cache-memory", str(KV_CACHE), "--kv-transport", "grpc", *PLACEMENT),
        ),
        prefill_args=layout[0],
        decode_args=layout[1],
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
    await wait_audit_clean(cluster, ledger, within_s=10.0)


def offline(
    target: Path,
    draft: Path,
    prompts: list[list[int]],
    data_parallel_size: int,
    tensor_parallel_size: int = 1,
) -> tuple[list[list[int]], LLMEngine]:
    """Greedy tokens from one in-process engine in the decode worker's layout."""
    engine = LLMEngine(
        EngineConfig(
            model=str(target),
            dtype="float32",
            block_size=BLOCK_SIZE,
            kv_cache_memory=KV_CACHE,
            num_threads=1,
            data_parallel_size=data_parallel_size,
            tensor_parallel_size=tensor_parallel_size,
            enable_expert_parallel=True,
            speculative=SpeculativeConfig(str(draft), num_draft_tokens=K),
        )
    )
    try:
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, params)
        done: dict[str, list[int]] = {}
        while engine.has_unfinished_requests():
            done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    finally:
        engine.close()
    return [done[str(i)] for i in range(len(prompts))], engine


async def test_greedy_equals_the_offline_engine(
    cluster: Cluster, model_dirs: dict[str, Path], layout: tuple[tuple[str, ...], tuple[str, ...]]
) -> None:
    prompts = PROMPTS * 2
    ours = await generate_all(cluster.router_address, prompts, max_tokens=MAX_TOKENS)
    refs, engine = offline(model_dirs["target"], model_dirs["mla"], prompts,
                           decode_ranks(layout), decode_tensor_parallel(layout))  # fmt: skip
    assert ours == refs
    assert engine.spec is not None
    expected = engine.spec.stats
    stats = (await worker_stats(cluster.decode[0])).speculative
    assert expected.num_draft_tokens > 0
    assert (stats.num_draft_tokens, stats.num_accepted_tokens) == (
        expected.num_draft_tokens,
        expected.num_accepted_tokens,
    )


async def test_requests_spread_over_both_ranks_and_the_ledger_agrees(
    cluster: Cluster, ledger: Ledger, layout: tuple[tuple[str, ...], tuple[str, ...]]
) -> None:
    """Mid-stream, every request holds its blocks: on both ranks (rank 1's numbered after
    rank 0's), and the ledger's holdings are the worker's, id for id. (Prompts that share
    no prefix: requests sharing a cached block would each hold it in the ledger.)"""
    if decode_ranks(layout) == 1:
        pytest.skip("one decode rank")  # the other layouts' test
    decode = cluster.decode[0]
    stats = await worker_stats(decode)
    per_rank = (stats.num_kv_blocks_used + stats.num_kv_blocks_free) // 2
    rng = random.Random(1)
    prompts = [[rng.randrange(3, TINY_VOCAB) for _ in range(9)] for _ in range(6)]
    streams = await start_streams(cluster.router_address, prompts, max_tokens=200, min_tokens=2)
    held = (await worker_stats(decode, include_block_ids=True)).owned_block_ids
    assert await audit_live(cluster, ledger) == []
    results = await asyncio.gather(*streams.tasks)
    assert min(held) < per_rank <= max(held)
    assert [len(tokens(chunks)) for chunks in results] == [200] * len(results)


async def test_a_reservation_names_its_rank(
    cluster: Cluster, ledger: Ledger, layout: tuple[tuple[str, ...], tuple[str, ...]]
) -> None:
    """Two reservations made straight to the decode worker: each on the rank with most
    blocks free (so one on each), named in the reply, its block ids that rank's."""
    if decode_ranks(layout) == 1:
        pytest.skip("one decode rank")  # the other layouts' test
    decode = cluster.decode[0]
    stats = await worker_stats(decode)
    per_rank = (stats.num_kv_blocks_used + stats.num_kv_blocks_free) // 2
    info = next(w for w in ledger.list_workers(WorkerRole.DECODE))
    owner, epoch = "a-router", 1
    ranks = []
    async with grpc.aio.insecure_channel(decode.address) as channel:
        stub = pb_grpc.DecodeWorkerStub(channel)
        for rid, prompt in (("named-0", [5, 6, 7, 8, 9]), ("named-1", [9, 8, 7])):
            ledger.create_request(rid, owner=owner, epoch=epoch)
            reply = await stub.Reserve(
                pb.ReserveRequest(
                    request_id=rid,
                    num_prompt_tokens=len(prompt),
                    prompt_token_ids=prompt,
                    router_id=owner,
                    router_epoch=epoch,
                    draft_fingerprint=info.stats["draft_fingerprint"],
                ),
                timeout=10,
            )
            assert {b // per_rank for b in reply.block_ids} == {reply.data_parallel_rank}
            ranks.append(reply.data_parallel_rank)
        for rid in ("named-0", "named-1"):
            await stub.Abort(pb.AbortRequest(request_id=rid, reason="test"), timeout=10)
            ledger.transition(rid, RequestState.FAILED, expected=RequestState.QUEUED, epoch=epoch)
    assert ranks == [0, 1]


async def test_requests_sharing_a_cached_prefix_are_not_double_held(
    cluster: Cluster, ledger: Ledger, layout: tuple[tuple[str, ...], tuple[str, ...]]
) -> None:
    """A request begun after another one's prompt landed shares its cached full blocks on
    the decode worker, which counts both holders (Stats' ref counts): the live audit, which
    compares the ledger's holders with those counts, finds nothing."""
    if decode_ranks(layout) != 1:
        pytest.skip("the second request goes to the emptier rank: nothing is shared")
    rng = random.Random(7)
    prefix = [rng.randrange(3, TINY_VOCAB) for _ in range(3 * BLOCK_SIZE)]
    first = await start_streams(cluster.router_address, [[*prefix, 5]], 200, min_tokens=2)
    second = await start_streams(cluster.router_address, [[*prefix, 6]], 200, min_tokens=2)
    stats = await worker_stats(cluster.decode[0], include_block_ids=True)
    counts = dict(zip(stats.owned_block_ids, stats.owned_block_ref_counts, strict=True))
    assert sorted(n for n in counts.values() if n > 1) == [2, 2, 2], counts
    assert await audit_live(cluster, ledger) == []
    for streams in (first, second):
        assert [len(tokens(c)) for c in await streams.results()] == [200]

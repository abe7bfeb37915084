"""The cluster on SmolLM2-135M (fp32; the Q4_1 GGUF dequantized): real router, prefill and
decode processes, real redis-server, loopback gRPC. Greedy output through 1 prefill + 1
decode and 2 + 2 workers, with each committed drafter, equals the in-process engine
token for token on 8 chat prompts; with one decode worker, the draft
counters equal those of one engine doing everything. After each cluster, the ledger audit
is clean."""

from __future__ import annotations

import json
import re
import statistics
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import httpx2 as httpx
import pytest
import redis
import torch
from transformers import AutoTokenizer, LlamaForCausalLM

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from engine.spec.config import SpeculativeConfig
from ledger.ledger import Ledger
from router.routing import REGISTRY_REFRESH_S
from serving.launcher import Cluster, ClusterSpec, Component
from tandem_client import AsyncTandemClient
from tests.comparator import compare_greedy
from tests.engine.test_smollm2_equality import QUESTIONS, chat_ids
from tests.services.cluster_helpers import (
    SERVICE_ARGS,
    assert_audit_clean,
    generate_all,
    run,
    tokens,
    worker_stats,
)

pytestmark = pytest.mark.slow

NEW_TOKENS = 32
K = 3
DRAFTS = Path(__file__).resolve().parents[2] / "drafts" / "smollm2"
WORKER_ARGS = ("--dtype", "float32", "--kv-cache-memory", str(96 << 20))


def draft_dir(kind: str | None) -> Path | None:
    if kind is None:
        return None
    path = DRAFTS / kind
    assert (path / "config.json").is_file(), f"the committed {kind} draft is missing: {path}"
    return path


@pytest.fixture(scope="module")
def prompts(smollm2_dir: Path) -> list[list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    return [chat_ids(tokenizer, q) for q in QUESTIONS]


def in_process(
    model: Path, prompts: list[list[int]], draft: Path | None = None
) -> tuple[list[list[int]], LLM]:
    """Greedy tokens of one engine doing everything (this process; 1 thread, since the
    cluster's processes share the cores)."""
    torch.set_num_threads(1)
    spec = SpeculativeConfig(str(draft), num_draft_tokens=K) if draft else None
    llm = LLM(str(model), dtype="float32", kv_cache_memory=96 << 20, speculative=spec)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    return [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)], llm


@pytest.fixture(scope="module")
def reference(smollm2_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    return in_process(smollm2_dir, prompts)[0]


@pytest.fixture
def ledger_of() -> Iterator[list[redis.Redis]]:
    clients: list[redis.Redis] = []
    yield clients
    for client in clients:
        client.close()


def start(model: Path, draft: Path | None, n: int, log_dir: Path) -> Cluster:
    spec = ClusterSpec(
        model=str(model),
        draft=str(draft) if draft else None,
        num_draft_tokens=K,
        adaptive_speculation=False,  # K every step: counters as one engine's
        num_prefill=n,
        num_decode=n,
        port=0,
        eager=True,  # the in-process engine it equals runs eagerly
        worker_args=WORKER_ARGS,
        service_args=SERVICE_ARGS,
        log_dir=log_dir,
        grace_s=5.0,
    )
    cluster = Cluster(spec).start(timeout_s=180)
    # The router is SERVING once one worker pair is registered, and it reads the registry
    # every 0.25 s: the test spreads its prompts over every worker, so it waits until the
    # router has read the registry again after the last worker joined.
    time.sleep(2 * REGISTRY_REFRESH_S)
    return cluster


def scrape(component: Component, name: str, label: str = "") -> float:
    """The sum of one metric's samples on ``component``'s /metrics, of those whose labels
    include ``label`` (e.g. 'status="finished"') when given."""
    with urllib.request.urlopen(component.metrics_url, timeout=5) as response:
        text = response.read().decode()
    samples = re.findall(rf"^{name}(\{{[^}}]*\}})? (\S+)$", text, re.M)
    return sum(float(value) for labels, value in samples if label in labels)


def assert_equal_up_to_ties(
    model: Path, prompts: list[list[int]], ours: list[list[int]], refs: list[list[int]]
) -> None:
    if ours == refs:
        return
    hf = LlamaForCausalLM.from_pretrained(str(model), dtype="float32").eval()
    result = compare_greedy(hf, prompts, ours, refs)
    assert result.num_ties <= 1, result


# Every drafter's KV through one prefill and one decode worker; routing among two of each
# once, with the drafter that carries the most (EAGLE-3's three target layers).
@pytest.mark.parametrize(
    ("kind", "n"),
    # Each drafter once (the suite's time budget); no drafter: test_cluster_tiny's plain
    # cluster, and the first-request test below runs EAGLE-3 in bf16.
    [("eagle3", 1), ("dflash", 1), ("eagle", 2)],
    ids=["eagle3-1p1d", "dflash-1p1d", "eagle-2p2d"],
)
async def test_greedy_through_cluster_equals_engine(
    smollm2_dir: Path,
    prompts: list[list[int]],
    reference: list[list[int]],
    kind: str | None,
    n: int,
    tmp_path: Path,
) -> None:
    draft = draft_dir(kind)
    cluster = start(smollm2_dir, draft, n, tmp_path / "logs")
    client = redis.Redis.from_url(cluster.redis_url, decode_responses=True)
    try:
        ours = await generate_all(cluster.router_address, prompts, NEW_TOKENS)
        stats = [await worker_stats(c) for c in cluster.decode]  # draft counters of those 8
        # The same prompt again goes where it went (prefix-aware routing) and finds its
        # prompt's KV in the prefill worker's prefix cache.
        greedy = {"max_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True}
        again = await run(cluster.router_address, prompts[7], **greedy)
        assert_equal_up_to_ties(smollm2_dir, [prompts[7]], [tokens(again)], [ours[7]])
        assert again[-1].usage.cached_tokens >= len(prompts[7]) // 32 * 16 > 0
        ledger = Ledger(client)
        await assert_audit_clean(cluster, ledger)
        # Every worker took part: prompts were spread over the prefill and decode pools.
        for component in cluster.prefill:
            assert scrape(component, "tandem_prefill_seconds_count") > 0, component.name
        # Finished ones only: a worker stalled past its lease (a loaded machine) aborts what
        # it held, and those requests finish elsewhere (migrated or prefilled again).
        finished = [scrape(c, "tandem_requests_total", 'status="finished"') for c in cluster.decode]
        assert sum(finished) == len(prompts) + 1 and min(finished) > 0, finished
    finally:
        client.close()
        cluster.stop()
    assert_equal_up_to_ties(smollm2_dir, prompts, ours, reference)
    if draft is None:
        assert not any(s.HasField("speculative") for s in stats)
        return
    # The drafts ran on the decode workers from the drafts and draft KV the prefill workers
    # sent. With one decode worker, exactly as many were accepted as in one engine.
    accepted = sum(s.speculative.num_accepted_tokens for s in stats)
    assert accepted > 0
    if n == 1 and ours == reference:
        spec_tokens, llm = in_process(smollm2_dir, prompts, draft)
        assert spec_tokens == ours
        assert llm.engine.spec is not None
        expected = llm.engine.spec.stats
        (only,) = stats
        assert (only.speculative.num_draft_tokens, only.speculative.num_accepted_tokens) == (
            expected.num_draft_tokens,
            expected.num_accepted_tokens,
        )


async def test_the_first_request_is_served_as_fast_as_later_ones(
    smollm2_dir: Path, prompts: list[list[int]], tmp_path: Path
) -> None:
    """`tandem serve`'s default (bf16, compiled): the cluster is SERVING only once its
    workers are warm (decode steps compiled, lazy set-up done), so the first request after
    it (through HTTP), and then the first through gRPC, get their first token within 3 s
    and within 3x of later requests' median (6th to 10th) on the same path. Without a
    draft: compiling EAGLE-3's steps too would add minutes to the suite, and its warm-up
    is the same code."""
    spec = ClusterSpec(
        model=str(smollm2_dir),
        port=0,
        worker_args=("--kv-cache-memory", str(96 << 20)),
        service_args=SERVICE_ARGS,
        log_dir=tmp_path / "logs",
        grace_s=5.0,
    )
    with Cluster(spec) as cluster:  # returns once the router says SERVING
        assert cluster.router is not None
        # HTTP first: the cluster's first request, through the router's chat template
        # and its HTTP stream; then the gRPC path's first.
        http_ttfts = await http_first_token_times(cluster.router.base_url, smollm2_dir.name)
        grpc_ttfts = await grpc_first_token_times(cluster.router_address, prompts)
    for ttfts in (grpc_ttfts, http_ttfts):
        shown = [round(t * 1000, 1) for t in ttfts]
        assert ttfts[0] <= FIRST_TOKEN_S, shown
        assert ttfts[0] <= 3 * statistics.median(ttfts[5:]), shown


FIRST_TOKEN_S = 3.0  # the first request's time to first token, on a 2-core machine


async def grpc_first_token_times(address: str, prompts: list[list[int]]) -> list[float]:
    """Time to first token of 10 requests, one after another, through the SDK."""
    ttfts = []
    async with AsyncTandemClient(address, timeout=60) as client:
        for prompt in [*prompts, *prompts][:10]:
            started = time.monotonic()
            async for _ in client.stream(prompt, max_tokens=2, temperature=0.0):
                ttfts.append(time.monotonic() - started)
                break
    return ttfts


async def http_first_token_times(base_url: str, model: str) -> list[float]:
    """Time to first token of 10 streamed chat completions, one after another, through
    the OpenAI-compatible API (the router's chat template, its HTTP stream)."""
    ttfts = []
    async with httpx.AsyncClient(timeout=60) as http:
        for question in [*QUESTIONS, *QUESTIONS][:10]:
            body = {
                "model": model,
                "messages": [{"role": "user", "content": question}],
                "max_tokens": 2,
                "temperature": 0,
                "stream": True,
            }
            started = time.monotonic()
            async with http.stream("POST", f"{base_url}/chat/completions", json=body) as reply:
                assert reply.status_code == 200, await reply.aread()
                async for line in reply.aiter_lines():
                    event = line.removeprefix("data: ")
                    if not line.startswith("data: ") or event == "[DONE]":
                        continue
                    choices = json.loads(event)["choices"]
                    if choices and choices[0]["delta"].get("content"):
                        ttfts.append(time.monotonic() - started)
                        break
    return ttfts


async def test_the_q4_1_file_through_the_cluster_equals_the_engine_on_it(
    prompts: list[list[int]], tmp_path: Path
) -> None:
    """The wheel's Q4_1 file served as it is (bf16 activations, its projections in their
    blocks), with the EAGLE-3 draft, through one prefill and one decode worker: greedy
    output equals the in-process engine's on the same file without a draft, token for
    token, and the served name is the prepared directory's. One request at a time on
    both sides: in bf16 a prompt's prefill attention depends on the prompts batched with
    it (the kernel's products do not: each row alone)."""
    from engine.model_store import prepare

    q4_dir = prepare("smollm2", keep_quantized=True)
    torch.set_num_threads(1)
    llm = LLM(str(q4_dir), kv_cache_memory=96 << 20)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    prompts = prompts[:4]
    reference = [llm.generate([p], params, use_tqdm=False)[0].token_ids for p in prompts]
    del llm
    spec = ClusterSpec(
        model=str(q4_dir),
        draft=str(draft_dir("eagle3")),
        num_draft_tokens=K,
        num_prefill=1,
        num_decode=1,
        port=0,
        eager=True,
        worker_args=("--kv-cache-memory", str(96 << 20)),
        service_args=SERVICE_ARGS,
        log_dir=tmp_path / "logs",
        grace_s=5.0,
    )
    greedy = {"max_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True}
    with Cluster(spec) as cluster:
        ours = [tokens(await run(cluster.router_address, p, **greedy)) for p in prompts]
        (stats,) = [await worker_stats(c) for c in cluster.decode]
        assert cluster.router is not None
        with urllib.request.urlopen(f"{cluster.router.base_url}/models", timeout=10) as r:
            served = [m["id"] for m in json.loads(r.read())["data"]]
    assert ours == reference
    assert stats.speculative.num_accepted_tokens > 0
    assert served == ["smollm2-q4_1"]

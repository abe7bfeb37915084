"""The SDK against a live tiny cluster (router, prefill and decode worker as real
processes, a real redis-server, an EAGLE-3 draft), sync and async: greedy output equals
the in-process engine; streams are contiguous and end with usage; leaving a stream early
cancels the request and frees its blocks; deadlines, bad requests and a stopped router
raise their exceptions; usage's speculative counters add up to the decode worker's; the
SDK needs no torch; the examples of docs/sdk.md and of the README's quick start run. Fakes
for the rest: test_sdk_fakes.py."""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from importlib.metadata import requires
from pathlib import Path

import pytest
import redis
import torch

from ledger.ledger import Ledger, RequestState
from serving.launcher import Cluster
from tandem_client import (
    AsyncTandemClient,
    Chunk,
    Completion,
    DeadlineExceeded,
    InvalidRequest,
    TandemClient,
    Unavailable,
)
from tests.doc_pages import README, code_blocks, page, section
from tests.engine.tiny_drafts import build_random_draft
from tests.services.cluster_helpers import (
    TINY_WORKER_ARGS,
    assert_greedy_equal,
    build_tiny_target,
    engine_greedy,
    tiny_cluster_spec,
    wait_audit_clean,
    worker_stats,
)

REPO = Path(__file__).resolve().parents[2]
VOCAB = 64
K = 3
MAX_TOKENS = 20
LONG = 1500  # tokens a request would take seconds to finish: it is stopped before
WORKER_ARGS = (*TINY_WORKER_ARGS, "--kv-cache-memory", str(24 << 20), "--kv-transport", "auto")


def prompts(n: int, seed: int, max_len: int = 16) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randint(1, max_len))] for _ in range(n)]


PROMPTS = prompts(6, seed=1)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    torch.set_num_threads(1)  # this process shares the cores with the cluster's
    out = tmp_path_factory.mktemp("sdk_tiny")
    build_tiny_target(out / "target")
    # Seed and scale picked so that some drafts are accepted (as test_cluster_tiny's).
    build_random_draft(out / "target", out / "eagle3", "eagle3", seed=1, std=0.3)
    return out / "target", out / "eagle3"


@pytest.fixture(scope="module")
def cluster(
    model_dirs: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    target, draft = model_dirs
    log_dir = tmp_path_factory.mktemp("sdk_logs")
    spec = tiny_cluster_spec(
        target,
        log_dir,
        draft=str(draft),
        num_draft_tokens=K,
        adaptive_speculation=False,  # K every step: drafts are counted
        worker_args=WORKER_ARGS,
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


@pytest.fixture(scope="module")
def greedy_refs(model_dirs: tuple[Path, Path]) -> list[list[int]]:
    return engine_greedy(model_dirs[0], PROMPTS, MAX_TOKENS)


@pytest.fixture(autouse=True)
async def audit_after_each_test(cluster: Cluster, ledger: Ledger) -> AsyncIterator[None]:
    """After every test: nothing held by any worker or in the ledger, nothing live."""
    yield
    await wait_audit_clean(cluster, ledger)


def check_chunks(chunks: list[Chunk]) -> None:
    """Indices consecutive from 0; finish reason and usage on the last chunk only."""
    index = 0
    for chunk in chunks:
        assert chunk.index == index
        index += len(chunk.token_ids)
    assert all(c.finish_reason is None and c.usage is None for c in chunks[:-1])
    last = chunks[-1]
    assert last.finish_reason in ("stop", "length") and last.usage is not None
    assert last.usage.completion_tokens == index


def check_greedy(answer: Completion, prompt: list[int]) -> list[int]:
    assert answer.finish_reason == "length" and answer.usage is not None
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (len(prompt), MAX_TOKENS)
    assert answer.usage.speculative is not None  # the draft runs
    return list(answer.token_ids)


def test_sync_generate_equals_engine_greedy(
    cluster: Cluster, model_dirs: tuple[Path, Path], greedy_refs: list[list[int]]
) -> None:
    with TandemClient(cluster.router_address, timeout=60) as client:
        answers = [
            client.generate(p, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
            for p in PROMPTS
        ]
    ours = [check_greedy(a, p) for a, p in zip(answers, PROMPTS, strict=True)]
    assert_greedy_equal(model_dirs[0], PROMPTS, ours, greedy_refs)


async def test_async_generate_equals_engine_greedy_and_counts_drafts(
    cluster: Cluster, model_dirs: tuple[Path, Path], greedy_refs: list[list[int]]
) -> None:
    """Concurrent requests; each one's speculative counters are its own, and together
    they are what the decode worker counted meanwhile."""
    before = (await worker_stats(cluster.decode[0])).speculative
    async with AsyncTandemClient(cluster.router_address, timeout=60) as client:
        answers = await asyncio.gather(
            *(
                client.generate(p, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
                for p in PROMPTS
            )
        )
    after = (await worker_stats(cluster.decode[0])).speculative
    ours = [check_greedy(a, p) for a, p in zip(answers, PROMPTS, strict=True)]
    assert_greedy_equal(model_dirs[0], PROMPTS, ours, greedy_refs)
    counts = [a.usage.speculative for a in answers if a.usage is not None]
    assert all(c is not None for c in counts) and len(counts) == len(PROMPTS)
    for c in counts:
        assert c is not None
        assert c.num_drafts > 0 and c.num_draft_tokens <= K * c.num_drafts
        assert c.num_accepted_tokens <= c.num_draft_tokens
    total = [sum(getattr(c, name) for c in counts) for name in SPEC_FIELDS]
    delta = [getattr(after, name) - getattr(before, name) for name in SPEC_FIELDS]
    assert total == delta
    assert total[2] > 0, "no draft accepted: the counters prove little"


SPEC_FIELDS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


def test_sync_stream_chunks_and_chat_prompt(cluster: Cluster) -> None:
    chat = [{"role": "user", "content": "hello there"}]
    with TandemClient(cluster.router_address, timeout=60) as client:
        chunks = list(client.stream(chat, max_tokens=24, temperature=0.0, logprobs=2))
        answer = client.generate("Once upon a time", request_id="sdk-text-1", max_tokens=8)
    check_chunks(chunks)
    assert all(len(c.logprobs) == len(c.token_ids) for c in chunks)
    assert all(len(lp.top) == 2 for c in chunks for lp in c.logprobs)
    assert answer.request_id == "sdk-text-1" and answer.logprobs is None
    assert answer.usage is not None and answer.usage.prompt_tokens == len("Once upon a time")


async def test_async_stream_chunks(cluster: Cluster) -> None:
    async with AsyncTandemClient(cluster.router_address, timeout=60) as client:
        chunks = [c async for c in client.stream([5, 6, 7], max_tokens=30, seed=7, ignore_eos=True)]
        assert (await client.health()) == "SERVING"
        (model,) = await client.models()
    check_chunks(chunks)
    assert chunks[-1].finish_reason == "length" and len(chunks) > 1
    assert model.draft_kind == "eagle3" and model.max_model_len == 2048


async def test_sync_break_mid_stream_cancels_the_request(cluster: Cluster, ledger: Ledger) -> None:
    def read_a_little() -> str:
        with TandemClient(cluster.router_address, timeout=60) as client:
            assert client.health() == "SERVING" and client.models()[0].draft_kind == "eagle3"
            stream = client.stream([9] * 8, max_tokens=LONG, temperature=0.0, ignore_eos=True)
            for chunk in stream:
                if chunk.index + len(chunk.token_ids) >= 8:
                    break
            return chunk.request_id

    request_id = await asyncio.to_thread(read_a_little)
    await wait_audit_clean(cluster, ledger, within_s=3.0)
    record = ledger.get_request(request_id)
    assert record is not None and record.state is RequestState.CANCELLED


async def test_async_break_mid_stream_cancels_the_request(cluster: Cluster, ledger: Ledger) -> None:
    async with AsyncTandemClient(cluster.router_address, timeout=60) as client:
        async for chunk in client.stream([9] * 8, max_tokens=LONG, ignore_eos=True):
            if chunk.index + len(chunk.token_ids) >= 8:
                request_id = chunk.request_id
                break
        # No aclose: the abandoned iterator alone cancels the call.
        await wait_audit_clean(cluster, ledger, within_s=3.0)
    record = ledger.get_request(request_id)
    assert record is not None and record.state is RequestState.CANCELLED


async def test_deadline_exceeded(cluster: Cluster) -> None:
    def sync_call() -> None:
        with TandemClient(cluster.router_address, timeout=0.5) as client:
            client.generate([4] * 6, max_tokens=LONG, ignore_eos=True)

    with pytest.raises(DeadlineExceeded) as raised:
        await asyncio.to_thread(sync_call)
    assert raised.value.message
    async with AsyncTandemClient(cluster.router_address) as client:
        with pytest.raises(DeadlineExceeded):
            async for _ in client.stream([4] * 6, max_tokens=LONG, timeout=0.5, ignore_eos=True):
                pass


async def test_invalid_requests_name_the_field(cluster: Cluster) -> None:
    def sync_call() -> None:
        with TandemClient(cluster.router_address) as client:
            client.generate([5, 6], max_tokens=0)

    with pytest.raises(InvalidRequest, match="max_tokens") as raised:
        await asyncio.to_thread(sync_call)
    assert re.match(r"max_tokens: ", raised.value.message), raised.value.message
    async with AsyncTandemClient(cluster.router_address) as client:
        with pytest.raises(InvalidRequest) as raised:
            await client.generate("hi", temperature=-1.0)
        assert raised.value.message.startswith("temperature: ")
        with pytest.raises(InvalidRequest) as raised:
            await client.generate("hi", model="no-such-model")
        assert raised.value.message.startswith("model: ")


def test_client_distribution_requires_no_torch() -> None:
    requirements = requires("tandem-client") or []
    names = {re.split(r"[\s<>=!~;\[]", r, maxsplit=1)[0].lower() for r in requirements}
    assert names and not names & {"torch", "transformers", "tokenizers"}, requirements


def run_python(code: str, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    """``code`` in a fresh interpreter importing this checkout's client."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "client"), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=env,
        cwd=REPO / "client",  # not the repository root: no server package on the path
        check=False,
    )


NO_TORCH = """
heavy = [m for m in ("torch", "transformers", "tokenizers") if m in sys.modules]
assert not heavy, f"imported {heavy}"
"""


async def test_sdk_in_a_fresh_interpreter_imports_no_torch(cluster: Cluster) -> None:
    code = f"""
import asyncio, json, sys
from tandem_client import AsyncTandemClient, TandemClient
with TandemClient({cluster.router_address!r}) as client:
    answer = client.generate([5, 6, 7], max_tokens=4, temperature=0.0, ignore_eos=True)
async def main():
    async with AsyncTandemClient({cluster.router_address!r}) as client:
        return [c.token_ids async for c in client.stream("abc", max_tokens=4)]
asyncio.run(main())
{NO_TORCH}
print(json.dumps(list(answer.token_ids)))
"""
    result = await asyncio.to_thread(run_python, code)
    assert result.returncode == 0, result.stderr
    assert len(json.loads(result.stdout.splitlines()[-1])) == 4


def sdk_examples() -> list[str]:
    """The ```python blocks of docs/sdk.md and of the README's "Quick start"."""
    on_page = code_blocks(page("sdk.md"))
    quick_start = code_blocks(section(README.read_text(), "Quick start"))
    assert on_page, "docs/sdk.md: no ```python block"
    assert quick_start, "README.md: no ```python block in its quick start"
    return on_page + quick_start


async def test_sdk_examples_run(cluster: Cluster) -> None:
    for block in sdk_examples():
        code, count = re.subn(
            r'^ROUTER = "[^"]*"', f"ROUTER = {cluster.router_address!r}", block, flags=re.M
        )
        assert count == 1, f"an example without its ROUTER line:\n{block}"
        result = await asyncio.to_thread(run_python, f"import sys\n{code}\n{NO_TORCH}")
        assert result.returncode == 0, f"{block}\n{result.stdout}\n{result.stderr}"


async def test_retry_reaches_a_restarted_router(cluster: Cluster) -> None:
    """Last: the router stops and comes back a second later on its port; a call made
    while it is down is retried until it answers. The module's last test."""
    router = cluster.router
    assert router is not None
    router.process.send_signal(signal.SIGTERM)  # drains (nothing in flight) and exits 0
    await asyncio.to_thread(router.process.wait, 30)
    async with AsyncTandemClient(cluster.router_address, max_retries=0) as client:
        with pytest.raises(Unavailable):
            await client.health(timeout=5)
    threading.Timer(1.0, cluster.restart, (router,)).start()
    started = time.monotonic()
    async with AsyncTandemClient(cluster.router_address, max_retries=12, backoff_s=0.2) as client:
        answer = await client.generate("abc", max_tokens=4, timeout=60)
    assert answer.usage is not None and time.monotonic() - started > 1.0

"""LoRA adapters served by a live tiny cluster (1 prefill + 1 decode worker, both started
with two PEFT adapters through ``--lora-modules``): the OpenAI ``model`` field and the
SDK's ``model=`` name an adapter or the base model, each request's fp32 greedy tokens
are the in-process engine's under the same adapter (prefilled on one worker under it,
decoded on the other), ``/v1/models`` and ListModels list the adapters with their
parent, an unknown name is a 404 (INVALID_ARGUMENT over gRPC) naming it, and the prefix cache
never hands one adapter's KV to another or to the base: the same prompt again under its
adapter hits the cache (usage's cached tokens), under another it does not."""

from __future__ import annotations

import random
import re
import shutil
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import httpx2 as httpx
import openai
import pytest
import torch
from transformers import LlamaForCausalLM

from engine.llm_engine import EngineConfig, LLMEngine
from engine.sampling_params import SamplingParams
from serving.launcher import Cluster
from tandem_client import AsyncTandemClient, Completion, InvalidRequest, TandemClient
from tests.engine.test_lora_adapter import save_adapter
from tests.engine.tiny_models import build_tiny_llama
from tests.services.cluster_helpers import (
    TINY_VOCAB,
    TINY_WORKER_ARGS,
    build_tiny_target,
    tiny_cluster_spec,
)

pytestmark = pytest.mark.timeout(300)
MODEL = "target"  # the served name: the model directory's
MAX_TOKENS = 12
MAX_RANK = 8  # the workers' --max-lora-rank


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Path]]:
    torch.set_num_threads(1)  # this process shares the cores with the cluster's
    out = tmp_path_factory.mktemp("lora_cluster")
    target = build_tiny_target(out / MODEL)
    load = lambda: LlamaForCausalLM.from_pretrained(target, dtype=torch.float32).eval()  # noqa: E731
    save_adapter(out / "a", load(), std=0.5, r=8, lora_alpha=16,
                 target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])  # fmt: skip
    save_adapter(out / "b", load(), std=0.5, r=4, lora_alpha=8,
                 target_modules=["gate_proj", "up_proj", "down_proj"])  # fmt: skip
    save_adapter(out / "c", load(), std=0.5, r=2, target_modules=["down_proj", "q_proj"])
    return target, {"sql-a": out / "a", "chat/b": out / "b"}


@pytest.fixture(scope="module")
def cluster(
    adapters: tuple[Path, dict[str, Path]], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    target, paths = adapters
    flags = [arg for name, path in paths.items() for arg in ("--lora-modules", f"{name}={path}")]
    runtime = ("--allow-runtime-lora", "--max-lora-rank", str(MAX_RANK))
    spec = tiny_cluster_spec(
        target,
        tmp_path_factory.mktemp("lora_logs"),
        worker_args=(*TINY_WORKER_ARGS, *flags, *runtime),
        router_args=("--allow-runtime-lora",),
    )
    with Cluster(spec) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def api(cluster: Cluster) -> openai.OpenAI:
    assert cluster.router is not None and cluster.router.base_url
    return openai.OpenAI(base_url=cluster.router.base_url, api_key="none", max_retries=0)


def engine_greedy(
    adapters: tuple[Path, dict[str, Path]], requests: list[tuple[list[int], str | None]]
) -> list[list[int]]:
    """The in-process engine's greedy tokens (fp32, block size 4 as the workers), each
    request under its adapter (None: the base), one at a time as the tests send them."""
    target, paths = adapters
    engine = LLMEngine(
        EngineConfig(model=str(target), dtype="float32", block_size=4, kv_cache_memory=8 << 20,
                     num_threads=1, lora_modules=tuple((n, str(p)) for n, p in paths.items()))
    )  # fmt: skip
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    outputs = []
    for i, (prompt, lora) in enumerate(requests):
        engine.add_request(str(i), prompt, params, lora=lora)
        while engine.has_unfinished_requests():
            done = [o.token_ids for o in engine.step() if o.finished]
        outputs += done
    return outputs


COUNTED = ("finished", "prompt", "generation")
MODEL_COUNTER = re.compile(
    r'tandem_model_(\w+)_total\{model="([^"]+)",role="router"(?:,status="(\w+)")?\} (\S+)'
)


def model_counts(cluster: Cluster) -> dict[tuple[str, str], float]:
    """The router's per-model counters: (model, "finished" | "prompt" | "generation"),
    and ("", "adapters"): the LoRA adapters gauge."""
    assert cluster.router is not None
    with urllib.request.urlopen(cluster.router.metrics_url, timeout=5) as response:
        text = response.read().decode()
    counts: dict[tuple[str, str], float] = {}
    for line in text.splitlines():
        found = MODEL_COUNTER.fullmatch(line)
        if found is not None:
            kind, model, status, value = found.groups()
            key = status if kind == "requests" else kind.removesuffix("_tokens")
            counts[(model, key)] = counts.get((model, key), 0) + float(value)
        elif line.startswith('tandem_lora_adapters{role="router"}'):
            counts[("", "adapters")] = float(line.split()[-1])
    return counts


def complete(api: openai.OpenAI, model: str, prompt: list[int]) -> tuple[str, int]:
    """The OpenAI completion's text and cached prompt tokens."""
    reply = api.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS,
                                   temperature=0.0, extra_body={"ignore_eos": True})  # fmt: skip
    assert reply.model == model and reply.usage is not None
    details = reply.usage.prompt_tokens_details
    return reply.choices[0].text, (details.cached_tokens or 0) if details else 0


def generate(sdk: TandemClient, model: str, prompt: list[int]) -> Completion:
    return sdk.generate(prompt, model=model, max_tokens=MAX_TOKENS, temperature=0.0,
                        ignore_eos=True)  # fmt: skip


def test_models_list_the_adapters_with_their_parent(cluster: Cluster, api: openai.OpenAI) -> None:
    cards = {m.id: m.model_dump() for m in api.models.list().data}
    assert set(cards) == {MODEL, "sql-a", "chat/b"}
    assert cards[MODEL]["parent"] is None
    assert cards["sql-a"]["parent"] == cards["chat/b"]["parent"] == MODEL
    with TandemClient(cluster.router_address) as sdk:
        listed = {m.name: m.parent for m in sdk.models()}
    assert listed == {MODEL: "", "sql-a": MODEL, "chat/b": MODEL}


def test_each_adapter_by_name_equals_the_engine_under_it(
    cluster: Cluster, api: openai.OpenAI, adapters: tuple[Path, dict[str, Path]]
) -> None:
    """Over gRPC (the SDK's model=) each request's tokens are the engine's under its
    adapter; through the openai client, the same text."""
    rng = random.Random(0)
    prompts = [[rng.randrange(3, TINY_VOCAB) for _ in range(n)] for n in (7, 10, 5)]
    models = ("sql-a", "chat/b", MODEL)
    requests = [(p, None if m == MODEL else m) for p in prompts for m in models]
    expected = engine_greedy(adapters, requests)
    for i in range(0, len(expected), 3):  # each adapter changes the output: applied or not
        assert len({tuple(e) for e in expected[i : i + 3]}) == 3, requests[i][0]
    before = model_counts(cluster)
    with TandemClient(cluster.router_address) as sdk:
        got = [generate(sdk, lora or MODEL, prompt) for prompt, lora in requests]
    assert [list(c.token_ids) for c in got] == expected
    texts = [complete(api, lora or MODEL, prompt)[0] for prompt, lora in requests]
    assert texts == [c.text for c in got]
    after = model_counts(cluster)  # the router's per-model counters: 2 x 3 requests each
    for model in models:
        got_counts = {k: after.get((model, k), 0) - before.get((model, k), 0) for k in COUNTED}
        prompt_tokens = 2 * sum(len(p) for p in prompts)
        assert got_counts == {"finished": 6, "prompt": prompt_tokens, "generation": 6 * MAX_TOKENS}
    assert after[("", "adapters")] == 2


def test_an_unknown_adapter_is_not_found(cluster: Cluster, api: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as e:
        api.completions.create(model="sql-c", prompt=[5, 6, 7], max_tokens=2)
    assert e.value.status_code == 404
    assert "model: unknown model 'sql-c'" in str(e.value)
    assert "'sql-a'" in str(e.value)  # what is served, adapters included
    with TandemClient(cluster.router_address) as sdk, pytest.raises(InvalidRequest, match="sql-c"):
        sdk.generate([5, 6, 7], model="sql-c", max_tokens=2)


def test_the_prefix_cache_keeps_each_adapters_kv_apart(api: openai.OpenAI) -> None:
    """The same 13-token prompt (3 whole blocks of 4): again under its adapter, its blocks
    come from the cache; under the other adapter or the base, none do (usage's cached
    tokens, which the prefill worker's prefix cache counts)."""
    prompt = random.Random(7).choices(range(3, TINY_VOCAB), k=13)
    first, cached = complete(api, "sql-a", prompt)
    assert cached == 0
    again, cached = complete(api, "sql-a", prompt)
    assert again == first and cached == 12
    for model in ("chat/b", MODEL):
        assert complete(api, model, prompt)[1] == 0, model


def post(cluster: Cluster, route: str, **body: object) -> httpx.Response:
    assert cluster.router is not None and cluster.router.base_url
    return httpx.post(f"{cluster.router.base_url}/{route}", json=body, timeout=120)


def test_an_adapter_loaded_and_unloaded_at_run_time(
    cluster: Cluster,
    api: openai.OpenAI,
    adapters: tuple[Path, dict[str, Path]],
    tmp_path: Path,
) -> None:
    """POST /v1/load_lora_adapter: both workers load it, and requests may name it at
    once, with the engine's tokens under it; /v1/unload_lora_adapter: gone (404). What
    a worker cannot serve is refused naming the field (400), and the cluster serves on
    without it."""
    target, _ = adapters
    path = target.parent / "c"
    prompt = [9, 17, 33, 4, 21, 8]
    engine = LLMEngine(EngineConfig(model=str(target), dtype="float32", block_size=4,
                                    kv_cache_memory=8 << 20, num_threads=1,
                                    lora_modules=(("c", str(path)),)))  # fmt: skip
    engine.add_request("0", prompt, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                                   ignore_eos=True), lora="c")  # fmt: skip
    while engine.has_unfinished_requests():
        expected = [o.token_ids for o in engine.step() if o.finished]
    loaded = post(cluster, "load_lora_adapter", lora_name="rt/c", lora_path=str(path))
    assert (loaded.status_code, loaded.text) == (
        200, "Success: LoRA adapter 'rt/c' added successfully."
    )  # fmt: skip
    assert "rt/c" in {m.id for m in api.models.list().data}
    with TandemClient(cluster.router_address) as sdk:
        assert list(generate(sdk, "rt/c", prompt).token_ids) == expected[0]
    again = post(cluster, "load_lora_adapter", lora_name="rt/c", lora_path=str(path))
    assert again.status_code == 400 and "lora_name: 'rt/c' is already loaded" in again.text
    unloaded = post(cluster, "unload_lora_adapter", lora_name="rt/c")
    assert (unloaded.status_code, unloaded.text) == (
        200, "Success: LoRA adapter 'rt/c' removed successfully."
    )  # fmt: skip
    with pytest.raises(openai.NotFoundError, match="unknown model 'rt/c'"):
        complete(api, "rt/c", prompt)
    missing = post(cluster, "unload_lora_adapter", lora_name="rt/c")
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "lora_name"

    corrupt = tmp_path / "corrupt"
    shutil.copytree(path, corrupt)
    (corrupt / "adapter_model.safetensors").write_bytes(b"\x00" * 64)
    load = lambda: LlamaForCausalLM.from_pretrained(target, dtype=torch.float32)  # noqa: E731
    save_adapter(tmp_path / "wide", load(), r=2 * MAX_RANK, target_modules=["q_proj"])
    build_tiny_llama(tmp_path / "other_base", "mha_plain", num_layers=2, vocab_size=TINY_VOCAB)
    other = LlamaForCausalLM.from_pretrained(tmp_path / "other_base", dtype=torch.float32)
    save_adapter(tmp_path / "other", other, r=2, target_modules=["q_proj"])
    for bad, error in (
        (corrupt, "adapter_model.safetensors: unreadable"),
        (tmp_path / "wide", f"r: {2 * MAX_RANK} exceeds the largest rank served, {MAX_RANK}"),
        (tmp_path / "other", "an adapter for another base model"),
    ):
        refused = post(cluster, "load_lora_adapter", lora_name="bad", lora_path=str(bad))
        assert refused.status_code == 400 and error in refused.json()["error"]["message"], bad
    named = post(cluster, "load_lora_adapter", lora_name=MODEL, lora_path=str(path))
    assert named.status_code == 400 and named.json()["error"]["param"] == "lora_name"
    assert {m.id for m in api.models.list().data} == {MODEL, "sql-a", "chat/b"}
    with TandemClient(cluster.router_address) as sdk:  # serving on: the workers are whole
        assert generate(sdk, "sql-a", prompt).finish_reason == "length"


async def test_an_adapter_in_use_is_not_unloaded(cluster: Cluster) -> None:
    """A stream under the adapter runs: unloading it is refused (409), and it stays."""
    async with AsyncTandemClient(cluster.router_address) as sdk:
        stream = sdk.stream([5, 6, 7], model="sql-a", max_tokens=1500, ignore_eos=True)
        async for _ in stream:  # its first chunk: decoding under the adapter
            break
        async with httpx.AsyncClient(timeout=60) as http:
            assert cluster.router is not None
            busy = await http.post(f"{cluster.router.base_url}/unload_lora_adapter",
                                   json={"lora_name": "sql-a"})  # fmt: skip
        await stream.aclose()
    assert busy.status_code == 409, busy.text
    assert "'sql-a' has 1 requests in flight" in busy.json()["error"]["message"]
    with TandemClient(cluster.router_address) as client:
        assert "sql-a" in {m.name for m in client.models()}

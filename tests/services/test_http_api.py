"""The router's OpenAI-compatible HTTP API on a real tiny cluster, with the official
``openai`` package as the client (and httpx for what it would not send): greedy text as
through gRPC and the in-process engine, chat and completions, streaming and not, stops,
n, logprobs, usage, OpenAI-shaped errors naming the field, unbuffered SSE, and a client
disconnect that cancels the request end to end."""

from __future__ import annotations

import json
import re
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx2 as httpx
import openai
import pytest
import redis
import torch
from tokenizers import Tokenizer
from transformers import LlamaForCausalLM

from ledger.ledger import Ledger, RequestState
from serving.launcher import Cluster, ClusterError
from tandem_client import InvalidRequest, TandemClient
from tests.doc_pages import code_blocks, page
from tests.services.cluster_helpers import (
    assert_greedy_equal,
    build_tiny_target,
    engine_greedy,
    run,
    tiny_cluster_spec,
    tokens,
    wait_audit_clean,
)

pytestmark = pytest.mark.timeout(300)
MODEL = "target"  # the served name: the model directory's


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.set_num_threads(1)  # this process shares the cores with the cluster's
    return build_tiny_target(tmp_path_factory.mktemp("http_api") / MODEL)


@pytest.fixture(scope="module")
def cluster(target: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    spec = tiny_cluster_spec(target, tmp_path_factory.mktemp("http_api_logs"), port=0)
    with Cluster(spec) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def base_url(cluster: Cluster) -> str:
    assert cluster.router is not None and cluster.router.base_url
    return cluster.router.base_url


@pytest.fixture(scope="module")
def ledger(cluster: Cluster) -> Iterator[Ledger]:
    client = redis.Redis.from_url(cluster.redis_url, decode_responses=True)
    yield Ledger(client)
    client.close()


@pytest.fixture
async def client(base_url: str) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0) as c:
        yield c


@pytest.fixture(autouse=True)
async def audit_after_each_test(cluster: Cluster, ledger: Ledger) -> AsyncIterator[None]:
    yield
    await wait_audit_clean(cluster, ledger)


def tokenizer(target: Path) -> Tokenizer:
    return Tokenizer.from_file(str(target / "tokenizer.json"))


async def test_models_and_health(base_url: str, client: openai.AsyncOpenAI) -> None:
    models = await client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    async with httpx.AsyncClient() as http:
        health = await http.get(base_url.removesuffix("/v1") + "/health")
        # loading LoRA adapters at run time is off without --allow-runtime-lora
        body = {"lora_name": "x", "lora_path": "/tmp"}
        load = await http.post(f"{base_url}/load_lora_adapter", json=body)
    assert health.status_code == 200 and health.json() == {"status": "ok"}
    assert load.status_code == 404 and load.json()["error"]["type"] == "not_found_error"


async def test_greedy_text_equals_grpc_and_the_engine(
    cluster: Cluster, target: Path, client: openai.AsyncOpenAI
) -> None:
    prompts = [[1, 20, 33, 41, 7, 9], [1, 5, 5, 60, 12]]
    for prompt in prompts:
        http = await client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        grpc_chunks = await run(
            cluster.router_address, prompt, max_tokens=24, temperature=0.0, ignore_eos=True
        )
        assert http.choices[0].text == "".join(c.text for c in grpc_chunks)
        assert http.choices[0].finish_reason == "length"
        assert http.usage is not None
        assert (http.usage.prompt_tokens, http.usage.completion_tokens) == (len(prompt), 24)
        ours = tokens(grpc_chunks)
        assert_greedy_equal(target, [prompt], [ours], engine_greedy(target, [prompt], 24))


async def test_chat_streams_what_it_answers_whole(target: Path, client: openai.AsyncOpenAI) -> None:
    messages = [{"role": "user", "content": "hello there"}]
    whole = await client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=20,
        temperature=0,  # type: ignore[arg-type]
    )
    stream = await client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=20, temperature=0,  # type: ignore[arg-type]
        stream=True, stream_options={"include_usage": True},
    )  # fmt: skip
    events = [event async for event in stream]
    assert events[0].choices[0].delta.role == "assistant"
    text = "".join(e.choices[0].delta.content or "" for e in events if e.choices)
    assert text == whole.choices[0].message.content
    assert events[-1].choices == [] and events[-1].usage is not None
    rendered = "<s>user: hello there</s><s>assistant: "
    prompt_tokens = len(tokenizer(target).encode(rendered, add_special_tokens=False).ids)
    assert events[-1].usage.prompt_tokens == prompt_tokens
    assert whole.usage is not None and whole.usage.prompt_tokens == prompt_tokens
    assert events[-1].usage.completion_tokens == whole.usage.completion_tokens
    finish = [e.choices[0].finish_reason for e in events if e.choices]
    assert finish[-1] == whole.choices[0].finish_reason and set(finish[:-1]) == {None}


async def test_stop_strings_and_several_choices(client: openai.AsyncOpenAI) -> None:
    prompt = "abc"
    greedy = await client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=30, temperature=0, extra_body={"ignore_eos": True}
    )
    text = greedy.choices[0].text
    stop = text[10:13]
    stopped = await client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=30, temperature=0, stop=[stop],
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == text[: text.index(stop)]

    two = await client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=16, temperature=1.0, seed=7, n=2,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert [c.index for c in two.choices] == [0, 1]
    assert two.choices[0].text != two.choices[1].text  # seeds 7 and 8
    again = await client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=16, temperature=1.0, seed=7, n=2,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert [c.text for c in again.choices] == [c.text for c in two.choices]
    assert two.usage is not None
    assert (
        two.usage.completion_tokens == 32 and two.usage.prompt_tokens == greedy.usage.prompt_tokens
    )  # type: ignore[union-attr]


async def test_logprobs_of_completions_and_chat(client: openai.AsyncOpenAI) -> None:
    out = await client.completions.create(
        model=MODEL, prompt="hello", max_tokens=6, temperature=0, logprobs=3,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    logprobs = out.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens is not None
    assert "".join(logprobs.tokens) == out.choices[0].text and len(logprobs.tokens) == 6
    assert logprobs.top_logprobs is not None and logprobs.token_logprobs is not None
    for token, logprob, top in zip(
        logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True
    ):
        assert len(top) == 3 and max(top.values()) == pytest.approx(logprob)
        assert top[token] == pytest.approx(logprob)  # greedy: the likeliest token
    assert logprobs.text_offset == list(range(6))  # one character per token

    chat = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5,
        temperature=0, logprobs=True, top_logprobs=2,
    )  # fmt: skip
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == chat.usage.completion_tokens  # type: ignore[union-attr]
    assert all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in content)


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        (b'{"model": "target", "prompt": "hi"', 400, None),  # malformed JSON
        (b'{"model": "target", "prompt": "hi", "max_tokens": "5"}', 400, "max_tokens"),
        (b'{"model": "target", "prompt": "hi", "max_tokens": -1}', 400, "max_tokens"),
        (b'{"model": "nope", "prompt": "hi"}', 404, "model"),
        (b'{"model": "target", "prompt": "hi", "temperature": 1000}', 400, "temperature"),
        (b'{"model": "target", "prompt": "hi", "suffix": "x"}', 400, "suffix"),
        (b'{"model": "target", "prompt": [70000]}', 400, "prompt"),
        (b'{"model": "target", "prompt": "hi", "n": 99}', 400, "n"),
        (b'{"model": "target", "prompt": "hi", "max_tokens": 1099511627776}', 400, "max_tokens"),
        (b'{"model": "target", "prompt": "hi", "stop_token_ids": [1099511627776]}', 400, "request"),
    ],
    ids=["json", "type", "negative", "model", "temperature", "suffix", "vocab", "n", "big", "wire"],
)
async def test_bad_completions_are_refused_naming_the_field(
    base_url: str, body: bytes, status: int, param: str | None
) -> None:
    async with httpx.AsyncClient() as http:
        reply = await http.post(
            f"{base_url}/completions", content=body, headers={"content-type": "application/json"}
        )
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and error["type"] and error["message"]
    if param is not None:
        assert error["message"].startswith(f"{param}:"), error["message"]
    else:
        assert error["message"].startswith("body: not valid JSON"), error["message"]


async def test_bad_chats_are_refused_naming_the_field(client: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}],
            tools=[{"type": "function", "function": {"name": "f"}}],
        )  # fmt: skip
    assert refused.value.body["param"] == "tools"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as refused:
        await client.chat.completions.create(model=MODEL, messages=[])
    assert refused.value.body["param"] == "messages"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        await client.chat.completions.create(
            model="gpt-4o", messages=[{"role": "user", "content": "x"}]
        )


async def test_events_are_sent_as_they_come(base_url: str) -> None:
    body = {
        "model": MODEL, "prompt": "ab", "max_tokens": 300, "temperature": 0,
        "ignore_eos": True, "stream": True,
    }  # fmt: skip
    arrivals: list[float] = []
    async with httpx.AsyncClient(timeout=60) as http:
        start = time.monotonic()
        async with http.stream("POST", f"{base_url}/completions", json=body) as reply:
            assert reply.status_code == 200
            assert reply.headers["content-type"].startswith("text/event-stream")
            lines = []
            async for line in reply.aiter_lines():
                if line.startswith("data: "):
                    arrivals.append(time.monotonic() - start)
                    lines.append(line)
    assert lines[-1] == "data: [DONE]"
    text = "".join(json.loads(x[6:])["choices"][0]["text"] for x in lines[:-1])
    assert len(text) == 300
    assert len(arrivals) > 10
    assert arrivals[0] < 0.5 * arrivals[-2], arrivals  # not held back until the end


async def test_a_client_disconnect_cancels_the_request(
    cluster: Cluster, base_url: str, ledger: Ledger
) -> None:
    body = {
        "model": MODEL, "prompt": "ab", "max_tokens": 1900, "temperature": 0,
        "ignore_eos": True, "stream": True,
    }  # fmt: skip
    async with (
        httpx.AsyncClient(timeout=60) as http,
        http.stream("POST", f"{base_url}/completions", json=body) as reply,
    ):
        lines = reply.aiter_lines()
        first = await anext(line async for line in lines if line.startswith("data: "))
    # leaving the block closed the connection mid-stream
    request_id = json.loads(first[6:])["id"] + "-0"
    await wait_audit_clean(cluster, ledger, within_s=1.0)
    record = ledger.get_request(request_id)
    assert record is not None and record.state is RequestState.CANCELLED, record


async def test_a_whole_answer_is_cancelled_when_its_client_goes(
    cluster: Cluster, base_url: str, ledger: Ledger
) -> None:
    body = {
        "model": MODEL, "prompt": "ab", "max_tokens": 1900, "temperature": 0, "ignore_eos": True,
    }  # fmt: skip
    before = requests_in(ledger, RequestState.CANCELLED)
    async with httpx.AsyncClient(timeout=0.5) as http:
        with pytest.raises(httpx.ReadTimeout):
            await http.post(f"{base_url}/completions", json=body)
    await wait_audit_clean(cluster, ledger, within_s=1.0)
    cancelled = requests_in(ledger, RequestState.CANCELLED) - before
    assert len(cancelled) == 1 and cancelled.pop().startswith("cmpl-"), cancelled


def requests_in(ledger: Ledger, state: RequestState) -> set[str]:
    """The ids of the ledger's requests in ``state``."""
    found = set()
    for key in ledger.client.scan_iter(match=f"{ledger.ns}:{{req:*}}", count=1000):
        match = re.fullmatch(rf"{ledger.ns}:\{{req:([^}}]+)\}}", key)
        if match and ledger.client.hget(key, "state") == state.value:
            found.add(match.group(1))
    return found


def test_the_docs_example_runs(base_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    """The ```python block of docs/http-api.md, against this cluster."""
    (block,) = code_blocks(page("http-api.md"))
    assert "http://127.0.0.1:8000/v1" in block and '"smollm2"' in block
    code = block.replace("http://127.0.0.1:8000/v1", base_url).replace('"smollm2"', f'"{MODEL}"')
    exec(compile(code, "docs/http-api.md", "exec"), {})
    # 32 sampled tokens, EOS ignored: one character each, or none for a special token
    assert 16 <= len(capsys.readouterr().out) <= 32


def test_a_started_cluster_is_not_started_again(cluster: Cluster) -> None:
    """A second set of components under the same ids would fight the first in the ledger."""
    with pytest.raises(ClusterError, match="already started"):
        cluster.start()


async def test_logit_bias_and_frequency_penalty_change_greedy_text(
    target: Path, client: openai.AsyncOpenAI
) -> None:
    """The engine's sampler applies them through HTTP: greedy repeats a character after
    "aaaa" on the tiny model and a frequency penalty repeats none; a -100 bias on greedy's
    first token replaces it; a logit_bias key that is not a token id is a 400 naming it."""

    async def greedy(**extra: object) -> str:
        out = await client.completions.create(
            model=MODEL, prompt="aaaa", max_tokens=16, temperature=0,
            extra_body={"ignore_eos": True}, **extra,  # type: ignore[arg-type]
        )  # fmt: skip
        return out.choices[0].text

    plain = await greedy()
    assert len(set(plain)) < len(plain) - 4, plain
    penalized = await greedy(frequency_penalty=2.0)
    assert len(set(penalized)) == len(penalized) and penalized != plain, penalized
    first = tokenizer(target).token_to_id(plain[0])
    biased = await greedy(logit_bias={str(first): -100})
    assert biased and biased[0] != plain[0], biased
    for bad, param in [({"logit_bias": {"a1": 5}}, "logit_bias"),
                       ({"frequency_penalty": 2.5}, "frequency_penalty")]:  # fmt: skip
        with pytest.raises(openai.BadRequestError) as refused:
            await client.completions.create(model=MODEL, prompt="a", **bad)  # type: ignore[call-overload]
        assert refused.value.body["param"] == param  # type: ignore[index]


def prompt_reference(target: Path, prompt: list[int]) -> torch.Tensor:
    """[P, V]: transformers' fp32 log-softmax at each prompt position (row i scores i + 1)."""
    hf = LlamaForCausalLM.from_pretrained(str(target), dtype="float32").eval()
    with torch.inference_mode():
        ids = torch.tensor([prompt])
        return torch.log_softmax(hf(ids, attention_mask=torch.ones_like(ids)).logits[0], -1)


ECHO_PROMPT = [1, 20, 33, 41, 7, 9, 12, 50, 8]


async def test_prompt_logprobs_through_the_sdk(cluster: Cluster, target: Path) -> None:
    """gRPC (SDK): prompt logprobs on the first chunk equal transformers' within 1e-4, with
    max_tokens 0 (the prompt only) and with a completion; max_tokens 0 alone is refused."""
    ref = prompt_reference(target, ECHO_PROMPT)
    with TandemClient(cluster.router_address, timeout=60, max_retries=0) as sdk:
        scored = sdk.generate(ECHO_PROMPT, max_tokens=0, prompt_logprobs=2)
        generated = sdk.generate(
            ECHO_PROMPT, max_tokens=3, temperature=0.0, ignore_eos=True, prompt_logprobs=0
        )
        with pytest.raises(InvalidRequest, match=r"max_tokens: must be"):
            sdk.generate(ECHO_PROMPT, max_tokens=0)
    assert scored.token_ids == () and scored.finish_reason == "length"
    assert scored.usage is not None
    assert (scored.usage.prompt_tokens, scored.usage.completion_tokens) == (len(ECHO_PROMPT), 0)
    assert len(generated.token_ids) == 3 and generated.prompt_logprobs is not None
    assert scored.prompt_logprobs is not None
    for entries, k in [(scored.prompt_logprobs, 2), (generated.prompt_logprobs, 0)]:
        assert [e.token_id for e in entries] == ECHO_PROMPT[1:]
        for i, e in enumerate(entries):
            assert abs(e.logprob - ref[i, ECHO_PROMPT[i + 1]].item()) < 1e-4
            top = ref[i].topk(k)
            assert [t.token_id for t in e.top] == top.indices.tolist()
            values = top.values.tolist()
            assert all(abs(t.logprob - v) < 1e-4 for t, v in zip(e.top, values, strict=True))


async def test_echo_with_logprobs_and_no_completion(
    target: Path, client: openai.AsyncOpenAI
) -> None:
    """lm-evaluation-harness's loglikelihood request: echo, logprobs, max_tokens 0."""
    ref = prompt_reference(target, ECHO_PROMPT)
    out = await client.completions.create(
        model=MODEL, prompt=ECHO_PROMPT, echo=True, logprobs=2, max_tokens=0
    )
    choice = out.choices[0]
    assert choice.text == tokenizer(target).decode(ECHO_PROMPT, skip_special_tokens=False)
    assert choice.finish_reason == "length"
    assert out.usage is not None
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(ECHO_PROMPT), 0)
    lp = choice.logprobs
    assert lp is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
    assert lp.tokens is not None and len(lp.tokens) == len(ECHO_PROMPT)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for i, (value, top) in enumerate(zip(lp.token_logprobs[1:], lp.top_logprobs[1:], strict=True)):
        assert abs(value - ref[i, ECHO_PROMPT[i + 1]].item()) < 1e-4  # type: ignore[operator]
        want = ref[i].topk(2).values.tolist()
        got = sorted(top.values(), reverse=True)
        assert all(abs(a - b) < 1e-4 for a, b in zip(got, want, strict=True)), (got, want)
    with pytest.raises(openai.BadRequestError) as refused:
        await client.completions.create(model=MODEL, prompt=ECHO_PROMPT, max_tokens=0)
    assert refused.value.body["param"] == "max_tokens"  # type: ignore[index]


async def test_echo_before_a_completion(target: Path, client: openai.AsyncOpenAI) -> None:
    """The prompt's text and logprobs come first, whole or streamed; the completion is the
    one asked without echo."""
    kw: dict[str, object] = dict(
        model=MODEL, prompt="hello world", max_tokens=5, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    plain = await client.completions.create(**kw)  # type: ignore[call-overload]
    whole = await client.completions.create(echo=True, logprobs=1, **kw)  # type: ignore[call-overload]
    assert whole.choices[0].text == "hello world" + plain.choices[0].text
    lp = whole.choices[0].logprobs
    num_prompt = len(tokenizer(target).encode("hello world").ids)
    assert len(lp.tokens) == num_prompt + 5 and lp.token_logprobs[0] is None
    assert all(v is not None for v in lp.token_logprobs[1:])
    assert lp.text_offset[num_prompt] == len("".join(lp.tokens[:num_prompt]))
    stream = await client.completions.create(echo=True, logprobs=1, stream=True, **kw)  # type: ignore[call-overload]
    texts, streamed = [], []
    async for event in stream:
        texts.append(event.choices[0].text)
        streamed.extend(event.choices[0].logprobs.token_logprobs)
    assert "".join(texts) == whole.choices[0].text and texts[0].startswith("hello world")
    assert len(streamed) == len(lp.token_logprobs) and streamed[0] is None


async def test_a_chat_without_max_tokens_may_fill_the_context(client: openai.AsyncOpenAI) -> None:
    reply = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "go on"}], temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert reply.usage is not None and reply.choices[0].finish_reason == "length"
    assert reply.usage.prompt_tokens + reply.usage.completion_tokens == 2048  # the context


async def test_a_body_over_the_limit_and_unknown_paths_are_openai_shaped(base_url: str) -> None:
    """4x the router's --max-request-bytes (1 MiB): refused before it is parsed."""
    big = b'{"model": "target", "prompt": "' + b"a" * (5 << 20) + b'"}'
    async with httpx.AsyncClient(timeout=30) as http:
        declared = await http.post(f"{base_url}/completions", content=big)

        async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: counted instead
            for start in range(0, len(big), 1 << 20):
                yield big[start : start + (1 << 20)]

        counted = await http.post(f"{base_url}/completions", content=chunks())
        missing = await http.get(f"{base_url}/nothing-here")
    for reply in (declared, counted):
        assert reply.status_code == 413, reply.text
        assert reply.json()["error"]["message"] == "body: over the router's limit of 4194304 bytes"
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"

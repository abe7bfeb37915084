"""``thinking_end`` end to end through a live tiny cluster (1 prefill + 1 decode worker,
structured output's module cluster: a random model with one token per character). The
marker is text the model emits on its own, taken from the in-process engine's
unconstrained output; a JSON-schema request with that marker is free up to it and
constrained after it, and the SDK over gRPC and the OpenAI HTTP API both return the
in-process engine's tokens for the same request (fp32 greedy)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import jsonschema
import openai
import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from engine.llm_engine import EngineConfig, LLMEngine
from engine.sampling_params import SamplingParams, StructuredOutput
from serving.launcher import Cluster
from tandem.v1 import generation_pb2 as gen
from tests.services.cluster_helpers import check_stream, run
from tests.structured import test_api

pytestmark = pytest.mark.timeout(300)

cluster = test_api.cluster  # the same fixture: the JSON character model behind a cluster

SCHEMA = test_api.SCHEMA
PROMPTS = ["give me json: ", "abc", "hello", "a json object", "x", "0123", "data", "q"]
MAX_TOKENS = 80
MARKER_LEN = 2  # characters (tokens) of the marker


@dataclass(frozen=True)
class Expected:
    """The in-process engine's answers to the prompt, and the marker taken from them."""

    prompt: list[int]
    marker: str
    num_thinking: int  # tokens up to and including the marker's end
    free: list[int]  # unconstrained greedy
    constrained: list[int]  # the schema after the marker, greedy

    @property
    def structured(self) -> dict[str, object]:
        return {"json_schema": SCHEMA, "thinking_end": self.marker}


def engine_greedy(
    model: Path, prompts: list[list[int]], spec: StructuredOutput | None
) -> list[list[int]]:
    """Greedy requests (fp32, block size 4 as the cluster's workers), one per prompt."""
    config = EngineConfig(
        model=str(model), dtype="float32", block_size=4, kv_cache_memory=8 << 20, num_threads=1
    )
    engine = LLMEngine(config)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, structured_output=spec)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
    return [done[str(i)] for i in range(len(prompts))]


def first_marker(tokenizer: PreTrainedTokenizerBase, tokens: list[int]) -> tuple[str, int] | None:
    """The first ``MARKER_LEN`` consecutive character tokens of ``tokens`` after its first
    two, whose text tokenizes back to them and occurs nowhere earlier: (text, end index).
    None if there is none (this random model often ends with EOS within a few tokens)."""
    for start in range(2, len(tokens) - MARKER_LEN):
        window = tokens[start : start + MARKER_LEN]
        if set(window) & set(tokenizer.all_special_ids):
            continue
        text = tokenizer.decode(window)
        if tokenizer.encode(text, add_special_tokens=False) != window:
            continue  # an unused id, which text cannot name
        earlier = tokenizer.decode(tokens[: start + MARKER_LEN - 1])
        if text not in earlier:
            return text, start + MARKER_LEN
    return None


@pytest.fixture(scope="module")
def expected(cluster: Cluster) -> Expected:
    """The first of a few prompts whose unconstrained answer holds a marker (EOS, which
    ends a constrained request even while it thinks, must not come before it)."""
    model = Path(cluster.spec.model)
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    prompts = [tokenizer.encode(text, add_special_tokens=False) for text in PROMPTS]
    outputs = zip(prompts, engine_greedy(model, prompts, None), strict=True)
    found = [(p, out, at) for p, out in outputs if (at := first_marker(tokenizer, out))]
    assert found, "no prompt's answer holds a marker"
    prompt, free, (marker, num_thinking) = found[0]
    spec = StructuredOutput("json_schema", json.dumps(SCHEMA), thinking_end=marker)
    (constrained,) = engine_greedy(model, [prompt], spec)
    return Expected(prompt, marker, num_thinking, free, constrained)


@pytest.fixture(scope="module")
def tokenizer(cluster: Cluster) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(cluster.spec.model)


def test_the_engine_thinks_freely_then_follows_the_schema(
    expected: Expected, tokenizer: PreTrainedTokenizerBase
) -> None:
    """Not vacuous: the marker comes from the model itself, the output up to it is the
    unconstrained one, and after it the grammar changed the output into valid JSON."""
    n = expected.num_thinking
    assert expected.constrained[:n] == expected.free[:n]
    assert tokenizer.decode(expected.constrained[:n]).endswith(expected.marker)
    assert expected.constrained[n:] != expected.free[n : len(expected.constrained)]
    after = expected.constrained[n:]
    assert len(expected.constrained) < MAX_TOKENS  # ended by the grammar
    assert after[-1] == tokenizer.eos_token_id  # the grammar's end, then EOS
    jsonschema.validate(json.loads(tokenizer.decode(after, skip_special_tokens=True)), SCHEMA)


async def test_grpc_sdk_returns_the_engines_tokens(cluster: Cluster, expected: Expected) -> None:
    chunks = await run(
        cluster.router_address,
        expected.prompt,
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        structured_output=expected.structured,
    )
    assert check_stream(chunks, MAX_TOKENS) == expected.constrained
    assert chunks[-1].finish_reason == gen.FINISH_REASON_STOP


async def test_openai_http_returns_the_engines_tokens(
    cluster: Cluster, expected: Expected, tokenizer: PreTrainedTokenizerBase
) -> None:
    assert cluster.router is not None and cluster.router.base_url
    async with openai.AsyncOpenAI(
        base_url=cluster.router.base_url, api_key="none", max_retries=0
    ) as client:
        reply = await client.completions.create(
            model="target",
            prompt=expected.prompt,
            max_tokens=MAX_TOKENS,
            temperature=0.0,
            extra_body={"guided_json": SCHEMA, "thinking_end": expected.marker},
        )
    (choice,) = reply.choices
    assert choice.finish_reason == "stop"
    assert reply.usage is not None and reply.usage.completion_tokens == len(expected.constrained)
    assert choice.text == tokenizer.decode(expected.constrained, skip_special_tokens=True)
    head = tokenizer.decode(expected.constrained[: expected.num_thinking], skip_special_tokens=True)
    assert choice.text.startswith(head) and head.endswith(expected.marker)
    jsonschema.validate(json.loads(choice.text[len(head) :]), SCHEMA)

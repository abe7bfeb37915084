"""Structured output through a tiny cluster (1 prefill + 1 decode worker: the prefill
worker samples the first token under the grammar, the decode worker rebuilds the grammar
from the tokens): the official ``openai`` client's ``response_format`` and vLLM's
``guided_*`` extras, gRPC's ``structured_output``, and refusals naming the problem."""

from __future__ import annotations

import json
import re
import string
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import jsonschema
import openai
import pytest
import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from serving.launcher import Cluster
from tandem.v1 import generation_pb2 as gen
from tandem.v1 import generation_pb2_grpc as gen_grpc
from tandem_client.request import build_request
from tests.engine.tiny_models import build_tiny_llama
from tests.services.cluster_helpers import tiny_cluster_spec

pytestmark = pytest.mark.timeout(300)

SPECIALS = ["<unk>", "<s>", "</s>"]  # eos 2, as the tiny models'
CHARS = string.ascii_lowercase + string.digits + ' {}[]":,.-'
VOCAB = 96  # the characters, then unused ids
SCHEMA = {
    "type": "object",
    "properties": {
        "a": {"enum": ["x", "yz"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "t": {"type": "array", "items": {"enum": ["p", "q"]}, "maxItems": 2},
    },
    "required": ["a", "n", "t"],
    "additionalProperties": False,
}
REGEX = "[a-c]{2}-[0-7]{3}"


def save_json_char_tokenizer(model_dir: Path) -> None:
    """One token per character, JSON's punctuation included."""
    vocab = {token: i for i, token in enumerate([*SPECIALS, *CHARS])}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    fast.chat_template = (
        "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
        "{% if add_generation_prompt %}<s>assistant: {% endif %}"
    )
    fast.save_pretrained(str(model_dir))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    torch.set_num_threads(1)  # this process shares the cores with the cluster's
    target = tmp_path_factory.mktemp("structured") / "target"
    build_tiny_llama(target, "mha_plain", num_layers=2, vocab_size=VOCAB)
    save_json_char_tokenizer(target)
    spec = tiny_cluster_spec(target, tmp_path_factory.mktemp("structured_logs"), port=0)
    with Cluster(spec) as cluster:
        yield cluster


@pytest.fixture
async def client(cluster: Cluster) -> AsyncIterator[openai.AsyncOpenAI]:
    assert cluster.router is not None and cluster.router.base_url
    base_url = cluster.router.base_url
    async with openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0) as c:
        yield c


CHAT = [{"role": "user", "content": "give me json"}]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
async def test_response_format_json_schema(client: openai.AsyncOpenAI, temperature: float):
    reply = await client.chat.completions.create(
        model="target",
        messages=CHAT,  # type: ignore[arg-type]
        max_tokens=80,
        temperature=temperature,
        seed=7,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True},
        },
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content or ""), SCHEMA)


async def test_response_format_json_object_and_guided_regex(client: openai.AsyncOpenAI):
    reply = await client.chat.completions.create(
        model="target",
        messages=CHAT,  # type: ignore[arg-type]
        max_tokens=24,
        temperature=0.0,
        response_format={"type": "json_object"},
    )
    assert (reply.choices[0].message.content or "").startswith("{")
    completion = await client.completions.create(
        model="target",
        prompt="abc",
        max_tokens=16,
        temperature=1.0,
        seed=3,
        n=2,
        extra_body={"guided_regex": REGEX},
    )
    for choice in completion.choices:
        assert re.fullmatch(REGEX, choice.text) and choice.finish_reason == "stop"


async def test_grpc_structured_output(cluster: Cluster):
    assert cluster.router is not None
    request = build_request("abc", max_tokens=16, temperature=0.0)
    request.sampling.structured_output.regex = REGEX
    async with grpc.aio.insecure_channel(cluster.router.address) as channel:
        chunks = [c async for c in gen_grpc.GenerationStub(channel).Generate(request)]
    assert re.fullmatch(REGEX, "".join(c.text for c in chunks))
    assert chunks[-1].finish_reason == gen.FINISH_REASON_STOP

    request.sampling.structured_output.json_schema = '{"type": "nope"}'
    async with grpc.aio.insecure_channel(cluster.router.address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            [c async for c in gen_grpc.GenerationStub(channel).Generate(request)]
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert 'structured_output.json_schema: Unsupported type "nope"' in (info.value.details() or "")


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"guided_json": "{nope"}, "structured_output.json_schema: is not valid JSON"),
        (
            {"guided_json": {"type": "nope"}},
            'structured_output.json_schema: Unsupported type "nope"',
        ),
        ({"guided_regex": "[a-"}, "structured_output.regex: Regex parsing error"),
        ({"guided_grammar": "root ::= nothing"}, "structured_output.grammar: "),
        ({"guided_regex": "a", "guided_grammar": 'root ::= "a"'}, "set one constraint per request"),
        (
            {"response_format": {"type": "json_schema"}},
            "response_format.json_schema.schema: is required",
        ),
        ({"response_format": {"type": "xml"}}, "response_format.type: must be one of"),
    ],
)
async def test_invalid_constraints_are_400_naming_the_problem(
    client: openai.AsyncOpenAI, extra: dict[str, object], message: str
):
    with pytest.raises(openai.BadRequestError) as info:
        await client.chat.completions.create(
            model="target",
            messages=CHAT,  # type: ignore[arg-type]
            max_tokens=4,
            extra_body=extra,
        )
    assert info.value.status_code == 400
    assert message in str(info.value.message)

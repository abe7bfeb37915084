"""The router's wire limits and the engine's SamplingParams agree: for edge values of every
field, the router refuses exactly what the engine refuses, with the engine's message."""

from __future__ import annotations

import math

import pytest

from engine import sampling_params as engine_limits
from engine.sampling_params import SamplingParams, SamplingParamsError
from router.validation import ValidationError, check_sampling
from serving.sampling import params_from_proto
from tandem.v1 import generation_pb2 as gen
from tandem_client import wire

U32 = 2**32 - 1
F32_ABOVE_ONE = 1.0000001  # the float32 just above 1
EDGES: dict[str, list[object]] = {
    "max_tokens": [0, 1, 2, U32],
    "temperature": [-1.0, -1e-7, -0.0, 0.0, 1e-45, 1.0, 100.0, 100.00001, 101.0, math.inf],
    "top_k": [0, 1, U32],
    "top_p": [-1.0, -0.0, 0.0, 1e-45, 0.5, 1.0, F32_ABOVE_ONE, math.inf],
    "min_p": [-1.0, -1e-45, -0.0, 0.0, 1.0, F32_ABOVE_ONE, -math.inf],
    "seed": [0, 1, 2**63 - 1, 2**63, 2**64 - 1],
    "stop": [
        [],
        [""],
        ["a"],
        ["a", ""],
        [f"s{i}" for i in range(wire.MAX_STOP_SEQUENCES)],
        [f"s{i}" for i in range(wire.MAX_STOP_SEQUENCES + 1)],
    ],
    "stop_token_ids": [[], [0], [U32]],
    "logprobs": [0, 1, wire.MAX_LOGPROBS, wire.MAX_LOGPROBS + 1, U32],
    "prompt_logprobs": [0, 1, wire.MAX_PROMPT_LOGPROBS, wire.MAX_PROMPT_LOGPROBS + 1, U32],
    "frequency_penalty": [-math.inf, -2.0000002, -2.0, -0.0, 0.0, 1.5, 2.0, 2.0000002, math.inf],
    "presence_penalty": [-math.inf, -2.0000002, -2.0, -0.0, 0.0, 1.5, 2.0, 2.0000002, math.inf],
    "repetition_penalty": [-1.0, -0.0, 0.0, 1e-45, 1.0, 1.3, 100.0, 100.00001, math.inf],
    "logit_bias": [
        {},
        {0: 0.0},
        {U32: -100.0},  # the vocabulary is checked with the model, not here
        {5: 100.0, 3: -100.0},
        {5: 100.00001},
        {5: -101.0, 7: 0.5},
        {5: math.inf},
        {5: -math.inf},
        {i: 1.0 for i in range(wire.MAX_LOGIT_BIAS_ENTRIES)},
        {i: 1.0 for i in range(wire.MAX_LOGIT_BIAS_ENTRIES + 1)},
    ],
    # What compiles is the engine's to say (tests/structured); the router checks the rest.
    "structured_output": [
        gen.StructuredOutput(),
        gen.StructuredOutput(json_object=True),
        gen.StructuredOutput(json_schema='{"type": "object"}'),
        gen.StructuredOutput(json_schema="true"),
        gen.StructuredOutput(json_schema=""),
        gen.StructuredOutput(json_schema="{nope"),
        gen.StructuredOutput(json_schema="[1]"),
        gen.StructuredOutput(regex=""),
        gen.StructuredOutput(regex="a+"),
        gen.StructuredOutput(grammar='root ::= "a"'),
    ],
}
CASES = [(f, v) for f, values in EDGES.items() for v in values]
NANS = [
    "temperature",
    "top_p",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
]


def refusals(message: gen.SamplingParams) -> tuple[str | None, str | None]:
    """(the router's message, the engine's message); None where one accepts."""
    try:
        check_sampling(message)
        router = None
    except ValidationError as e:
        router = str(e)
    try:
        params_from_proto(message)
        engine = None
    except SamplingParamsError as e:
        engine = str(e)
    return router, engine


@pytest.mark.parametrize(("field", "value"), CASES, ids=[f"{f}={v!r}"[:40] for f, v in CASES])
def test_the_router_refuses_what_the_engine_refuses(field: str, value: object) -> None:
    message = gen.SamplingParams(**{field: value})
    router, engine = refusals(message)
    assert router == engine


@pytest.mark.parametrize("field", NANS)
def test_nan_is_refused_on_both_sides(field: str) -> None:
    router, engine = refusals(gen.SamplingParams(**{field: math.nan}))
    assert engine is not None and engine.startswith(f"{field}: ")
    assert router == engine


def test_nan_bias_is_refused_on_both_sides() -> None:
    router, engine = refusals(gen.SamplingParams(logit_bias={3: 0.0, 4: math.nan}))
    assert engine == "logit_bias: the bias of token 4 must be in [-100, 100], got nan"
    assert router == engine


def test_penalties_and_bias_reach_the_engine() -> None:
    message = gen.SamplingParams(
        frequency_penalty=0.5, presence_penalty=-1.0, repetition_penalty=1.25,
        logit_bias={9: -100.0, 2: 3.5},
    )  # fmt: skip
    params = params_from_proto(message)
    assert (params.frequency_penalty, params.presence_penalty) == (0.5, -1.0)
    assert params.repetition_penalty == 1.25
    assert params.logit_bias == ((2, 3.5), (9, -100.0))
    assert params_from_proto(gen.SamplingParams()).repetition_penalty == 1.0
    assert not params_from_proto(gen.SamplingParams()).uses_penalties


def test_unset_fields_are_accepted_and_defaults_agree() -> None:
    assert refusals(gen.SamplingParams()) == (None, None)
    assert SamplingParams().max_tokens == wire.DEFAULT_MAX_TOKENS
    assert wire.MAX_STOP_SEQUENCES == engine_limits.MAX_STOP_SEQUENCES
    assert wire.MAX_LOGPROBS == engine_limits.MAX_LOGPROBS
    assert wire.MAX_PROMPT_LOGPROBS == engine_limits.MAX_PROMPT_LOGPROBS
    for name in (
        "MAX_FREQUENCY_PENALTY",
        "MAX_REPETITION_PENALTY",
        "MAX_LOGIT_BIAS",
        "MAX_LOGIT_BIAS_ENTRIES",
    ):
        assert getattr(wire, name) == getattr(engine_limits, name), name


def test_every_field_of_the_message_has_edges() -> None:
    checked = {"ignore_eos", "speculative"}  # bools: nothing to refuse
    fields = {f.name for f in gen.SamplingParams.DESCRIPTOR.fields}
    assert fields == set(EDGES) | checked


def test_the_stop_count_is_refused_before_the_rest() -> None:
    message = gen.SamplingParams(max_tokens=0, stop=["a"] * (wire.MAX_STOP_SEQUENCES + 1))
    with pytest.raises(ValidationError, match=r"^stop: at most 16 stop strings, got 17$"):
        check_sampling(message)


def test_the_edges_cross_every_limit() -> None:
    """Each field's table holds accepted and refused values (uint32 fields cannot go below 0)."""
    unrefusable = {"top_k", "stop_token_ids"}
    for field, values in EDGES.items():
        outcomes = {refusals(gen.SamplingParams(**{field: v}))[1] is None for v in values}
        assert outcomes == ({True} if field in unrefusable else {True, False}), field


@pytest.mark.parametrize("prompt_logprobs", [None, 0, 3])
@pytest.mark.parametrize("max_tokens", [0, 1])
def test_max_tokens_zero_only_with_prompt_logprobs(
    max_tokens: int, prompt_logprobs: int | None
) -> None:
    message = gen.SamplingParams(max_tokens=max_tokens, prompt_logprobs=prompt_logprobs)
    router, engine = refusals(message)
    assert router == engine
    assert (engine is None) == (max_tokens > 0 or prompt_logprobs is not None)

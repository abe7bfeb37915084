"""The validator without the engine: what a valid request carries to the workers, and the
router's own refusals (those of the wire limits are in test_sampling_limits.py)."""

from __future__ import annotations

import pytest

from router.validation import ModelInfo, RequestValidator, ValidationError
from tandem.v1 import generation_pb2 as gen
from tandem_client import wire

MODEL = ModelInfo(name="tiny", vocab_size=64, max_model_len=32)


def request(ids: list[int], **sampling: object) -> gen.GenerateRequest:
    return gen.GenerateRequest(
        token_ids=gen.TokenIds(ids=ids), sampling=gen.SamplingParams(**sampling)
    )


def test_a_seed_is_drawn_once_and_a_given_one_kept() -> None:
    validator = RequestValidator(MODEL, None)
    valid = validator.validate(request([5, 6]))
    assert valid.sampling.HasField("seed") and 0 <= valid.sampling.seed < 2**63
    assert valid.max_tokens == wire.DEFAULT_MAX_TOKENS
    assert not valid.sampling.HasField("max_tokens")  # the workers apply the same default
    kept = validator.validate(request([5, 6], seed=7, max_tokens=3, top_p=0.5, stop_token_ids=[2]))
    assert kept.prompt_token_ids == [5, 6]
    assert (kept.sampling.seed, kept.max_tokens, kept.sampling.top_p) == (7, 3, 0.5)
    assert list(kept.sampling.stop_token_ids) == [2]


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (request([5], max_tokens=0), "max_tokens: must be an integer >= 1, got 0"),
        (
            request([5] * 20, max_tokens=13),
            "max_tokens: prompt (20 tokens) + max_tokens (13) = 33 exceeds the context length 32",
        ),
        (request([5], stop=["x"]), "stop: stop strings need a tokenizer; use stop_token_ids"),
        (
            request([5], stop_token_ids=[64]),
            "stop_token_ids: token id 64 is outside the vocabulary [0, 64)",
        ),
        (request([5], logprobs=21), "logprobs: must be in [0, 20], got 21"),
        (
            request([5], logit_bias={70: 1.0, 3: 1.0, 64: -1.0}),
            "logit_bias: token id 64 is outside the vocabulary [0, 64)",
        ),
        (request([5], frequency_penalty=2.5), "frequency_penalty: must be in [-2, 2], got 2.5"),
        (
            request([5], repetition_penalty=0.0),
            "repetition_penalty: must be in (0, 100] (1 is off), got 0.0",
        ),
        (gen.GenerateRequest(text="hi"), "text: model 'tiny' has no tokenizer; send token_ids"),
    ],
)
def test_refusals_name_the_field(bad: gen.GenerateRequest, message: str) -> None:
    with pytest.raises(ValidationError) as info:
        RequestValidator(MODEL, None).validate(bad)
    assert str(info.value) == message

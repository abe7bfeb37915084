"""SamplingParams rejects every out-of-range field with a message that names it."""

from __future__ import annotations

import pytest

from engine.sampling_params import (
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_LOGPROBS,
    MAX_STOP_SEQUENCES,
    SamplingParams,
    SamplingParamsError,
)

BAD = [
    ("max_tokens", {"max_tokens": 0}),
    ("max_tokens", {"max_tokens": -3}),
    ("max_tokens", {"max_tokens": 2.0}),
    ("temperature", {"temperature": -1.0}),
    ("temperature", {"temperature": 100.5}),
    ("top_k", {"top_k": -1}),
    ("top_p", {"top_p": 0.0}),
    ("top_p", {"top_p": 1.5}),
    ("min_p", {"min_p": 2.0}),
    ("min_p", {"min_p": -0.1}),
    ("seed", {"seed": -1}),
    ("seed", {"seed": 2**63}),
    ("stop", {"stop": tuple(f"s{i}" for i in range(MAX_STOP_SEQUENCES + 1))}),
    ("stop", {"stop": ("ok", "")}),
    ("stop_token_ids", {"stop_token_ids": (3, -1)}),
    ("logprobs", {"logprobs": MAX_LOGPROBS + 1}),
    ("logprobs", {"logprobs": -1}),
    ("frequency_penalty", {"frequency_penalty": 2.5}),
    ("frequency_penalty", {"frequency_penalty": float("nan")}),
    ("presence_penalty", {"presence_penalty": -2.01}),
    ("repetition_penalty", {"repetition_penalty": 0.0}),
    ("repetition_penalty", {"repetition_penalty": 101.0}),
    ("logit_bias", {"logit_bias": {5: 100.5}}),
    ("logit_bias", {"logit_bias": {-1: 1.0}}),
    ("logit_bias", {"logit_bias": {"5": 1.0}}),
    ("logit_bias", {"logit_bias": [1, 2]}),
    ("logit_bias", {"logit_bias": {i: 0.0 for i in range(MAX_LOGIT_BIAS_ENTRIES + 1)}}),
]


@pytest.mark.parametrize(("field", "kwargs"), BAD, ids=[f"{f}={kw[f]}"[:40] for f, kw in BAD])
def test_bad_parameter_raises_naming_the_field(field: str, kwargs: dict) -> None:
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(**kwargs)
    assert str(info.value).startswith(f"{field}:"), str(info.value)
    assert isinstance(info.value, ValueError)


def test_boundary_values_are_accepted() -> None:
    p = SamplingParams(
        max_tokens=1,
        temperature=0.0,
        top_k=0,
        top_p=1.0,
        min_p=1.0,
        seed=2**63 - 1,
        stop=tuple(f"s{i}" for i in range(MAX_STOP_SEQUENCES)),
        stop_token_ids=(0,),
        logprobs=MAX_LOGPROBS,
    )
    assert p.is_greedy
    assert SamplingParams(temperature=100.0, seed=0, logprobs=0).seed == 0
    assert not SamplingParams(temperature=0.5).is_greedy


def test_lists_become_tuples() -> None:
    p = SamplingParams(stop=["a", "b"], stop_token_ids=[1, 2])  # type: ignore[arg-type]
    assert p.stop == ("a", "b")
    assert p.stop_token_ids == (1, 2)
    hash(p)  # frozen and hashable


def test_penalties_and_bias_at_their_bounds() -> None:
    p = SamplingParams(
        frequency_penalty=-2.0,
        presence_penalty=2.0,
        repetition_penalty=100.0,
        logit_bias={i: i % 201 - 100.0 for i in range(MAX_LOGIT_BIAS_ENTRIES)},
    )
    assert p.uses_penalties and len(p.logit_bias) == MAX_LOGIT_BIAS_ENTRIES
    assert not SamplingParams().uses_penalties
    assert SamplingParams(repetition_penalty=0.5).uses_penalties


def test_logit_bias_is_kept_as_sorted_pairs() -> None:
    p = SamplingParams(logit_bias={7: -1.0, 2: 3.0})
    assert p.logit_bias == ((2, 3.0), (7, -1.0)) == p.bias_pairs
    assert SamplingParams(logit_bias=[(7, -1.0), (2, 3.0)]) == p
    hash(p)  # still frozen and hashable

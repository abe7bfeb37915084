"""Grammars with the EAGLE and DFlash drafters on SmolLM2-135M fp32 (EAGLE-3: test_engine):
every output valid, greedy output token for token that of no draft, sampled drafts
(``sample_drafts``) valid; and ``thinking_end``: free output up to the marker, the grammar
after it, the same with and without a drafter."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from engine.llm_engine import EngineConfig, LLMEngine
from engine.sampling_params import SamplingParams, StructuredOutput
from engine.spec.config import SpeculativeConfig
from tests.engine.test_smollm2_equality import chat_ids
from tests.structured.conftest import COMMITTED, PHONE, PHONE_SPEC
from tests.structured.test_engine import assert_drafts_allowed

COLOR = {
    "type": "object",
    "properties": {"color": {"enum": ["red", "green", "blue"]}},
    "required": ["color"],
    "additionalProperties": False,
}
# SmolLM2's greedy answer to "Pick a color." is "The color is: Red": " is:" (two tokens)
# comes early, and the grammar after it forbids " Red".
THINKING_END = " is:"
AFTER_THINKING = r" (red|green|blue)"
MAX_TOKENS = 24


def requests(tokenizer) -> dict[str, tuple[list[int], SamplingParams]]:
    phone = chat_ids(tokenizer, "Give me a phone number.")
    color = chat_ids(tokenizer, "Pick a color.")

    def p(spec: StructuredOutput | None, temperature: float = 0.0) -> SamplingParams:
        return SamplingParams(
            max_tokens=MAX_TOKENS, temperature=temperature, seed=7, structured_output=spec
        )

    thinking = StructuredOutput("regex", AFTER_THINKING, thinking_end=THINKING_END)
    return {
        "phone_greedy": (phone, p(PHONE_SPEC)),
        "phone_sampled": (phone, p(PHONE_SPEC, 0.8)),
        "color_greedy": (color, p(StructuredOutput("json_schema", json.dumps(COLOR)))),
        "thinking_greedy": (color, p(thinking)),
        "free_greedy": (color, p(None)),
    }


def run(engine: LLMEngine, reqs) -> dict[str, list[int]]:
    for rid, (prompt, params) in reqs.items():
        engine.add_request(rid, prompt, params)
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
        if engine.spec is not None:
            assert_drafts_allowed(engine)
    return done


def text(tokenizer, tokens: list[int]) -> str:
    return tokenizer.decode(tokens, skip_special_tokens=True)


@pytest.fixture(scope="module")
def plain(plain_engine, tokenizer) -> dict[str, list[int]]:
    return run(plain_engine, requests(tokenizer))


@pytest.fixture(scope="module", params=["eagle", "dflash"])
def drafted(request, smollm2_dir, tokenizer) -> tuple[LLMEngine, dict[str, list[int]]]:
    spec = SpeculativeConfig(str(COMMITTED / request.param), num_draft_tokens=3, sample_drafts=True)
    config = EngineConfig(
        model=str(smollm2_dir), dtype="float32", kv_cache_memory=96 << 20, speculative=spec
    )
    engine = LLMEngine(config, tokenizer)
    return engine, run(engine, requests(tokenizer))


def check_valid(tokenizer, out: dict[str, list[int]]) -> None:
    for rid in ("phone_greedy", "phone_sampled"):
        assert re.fullmatch(PHONE, text(tokenizer, out[rid])), rid
    jsonschema.validate(json.loads(text(tokenizer, out["color_greedy"])), COLOR)
    for rid in ("phone_greedy", "phone_sampled", "color_greedy", "thinking_greedy"):
        assert out[rid][-1] == tokenizer.eos_token_id, rid  # the grammar's end, then EOS


def test_thinking_end_frees_the_output_up_to_the_marker(plain, tokenizer):
    free = text(tokenizer, plain["free_greedy"])
    thinking = text(tokenizer, plain["thinking_greedy"])
    head = free[: free.index(THINKING_END) + len(THINKING_END)]
    assert head == "The color is:" and not re.fullmatch(AFTER_THINKING, free[len(head) :])
    assert thinking.startswith(head) and re.fullmatch(AFTER_THINKING, thinking[len(head) :])
    check_valid(tokenizer, plain)


def test_drafters_with_grammars_are_valid_and_change_no_greedy_token(drafted, plain, tokenizer):
    engine, out = drafted
    check_valid(tokenizer, out)
    for rid in ("phone_greedy", "color_greedy", "thinking_greedy", "free_greedy"):
        assert out[rid] == plain[rid], rid
    assert engine.spec is not None and engine.spec.stats.num_accepted_tokens > 0

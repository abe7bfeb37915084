"""Constrained decoding in the engine on SmolLM2-135M fp32: outputs valid against their
schema or regex, greedy and sampled, with and without EAGLE-3; speculation changes no
token; constrained and unconstrained rows in one batch leave each other alone; drafts
never propose a token the grammar forbids; thinking rows go unmasked."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams, StructuredOutput
from tests.engine.joined import drain_joined
from tests.engine.test_smollm2_equality import chat_ids
from tests.structured.conftest import PERSON, PERSON_SPEC, PHONE, PHONE_SPEC

pytestmark = pytest.mark.slow  # about 6 min of a loaded 2-core machine, SmolLM2 in fp32
MAX_TOKENS = 48


def requests(tokenizer) -> dict[str, tuple[list[int], SamplingParams]]:
    person = chat_ids(tokenizer, "Describe a person as JSON.")
    phone = chat_ids(tokenizer, "Give me a phone number.")
    free = chat_ids(tokenizer, "What is the capital of France?")

    def p(spec: StructuredOutput | None, temperature: float, seed: int = 0) -> SamplingParams:
        return SamplingParams(
            max_tokens=MAX_TOKENS, temperature=temperature, seed=seed, structured_output=spec
        )

    return {
        "person_greedy": (person, p(PERSON_SPEC, 0.0)),
        "person_sampled": (person, p(PERSON_SPEC, 1.0, seed=3)),
        "phone_greedy": (phone, p(PHONE_SPEC, 0.0)),
        "phone_sampled": (phone, p(PHONE_SPEC, 0.8, seed=5)),
        "free_greedy": (free, p(None, 0.0)),
    }


def run(engine: LLMEngine, reqs, *, check_drafts: bool = False) -> dict[str, list[int]]:
    for rid, (prompt, params) in reqs.items():
        engine.add_request(rid, prompt, params)
    done: dict[str, list[int]] = {}
    num_checked = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                assert out.finish_reason == "stop" or out.request_id.startswith("free")
                done[out.request_id] = out.token_ids
        if check_drafts:
            num_checked += assert_drafts_allowed(engine)
    assert not check_drafts or num_checked > 0
    return done


def assert_drafts_allowed(engine: LLMEngine) -> int:
    """Replays each running grammar row's drafts on its matcher: each is allowed."""
    num_checked = 0
    for seq in engine._seqs.values():
        row = seq.grammar
        if row is None or not seq.draft_token_ids or row.is_terminated:
            continue
        advanced = 0
        for token in seq.draft_token_ids:
            if row.is_terminated:
                break
            assert row.try_advance(token), f"{seq.request_id}: draft {token} is forbidden"
            advanced += 1
            num_checked += 1
        row.rollback(advanced)
    return num_checked


@pytest.fixture(scope="module")
def outputs(plain_engine, spec_engine, tokenizer):
    reqs = requests(tokenizer)
    return reqs, run(plain_engine, reqs), run(spec_engine, reqs, check_drafts=True)


def check_valid(tokenizer, rid: str, tokens: list[int]) -> None:
    text = tokenizer.decode(tokens, skip_special_tokens=True)
    if rid.startswith("person"):
        jsonschema.validate(json.loads(text), PERSON)
    elif rid.startswith("phone"):
        assert re.fullmatch(PHONE, text), text


def test_outputs_are_valid_with_and_without_speculation(outputs, tokenizer):
    reqs, plain, spec = outputs
    for rid in reqs:
        if rid.startswith("free"):
            continue
        check_valid(tokenizer, rid, plain[rid])
        check_valid(tokenizer, rid, spec[rid])
        assert plain[rid][-1] == tokenizer.eos_token_id  # the grammar's end, then EOS


def test_speculation_changes_no_token(outputs, spec_engine):
    """Greedy rows: argmax of the same masked logits; sampled rows: lossless acceptance
    draws each emitted token as target-only sampling does at its position."""
    _, plain, spec = outputs
    assert spec == plain
    assert spec_engine.spec is not None and spec_engine.spec.stats.num_accepted_tokens > 0


def test_mixed_batch_rows_leave_each_other_alone(outputs, plain_engine, tokenizer):
    reqs, plain, _ = outputs
    alone = {rid: reqs[rid] for rid in ("free_greedy",)}
    assert run(plain_engine, alone)["free_greedy"] == plain["free_greedy"]
    alone = {"person_greedy": reqs["person_greedy"]}
    assert run(plain_engine, alone)["person_greedy"] == plain["person_greedy"]


def test_thinking_rows_are_not_masked(spec_engine, tokenizer):
    """A row in a thinking phase decodes as if unconstrained (acceptance unchanged)."""
    prompt = chat_ids(tokenizer, "What is the capital of France?")
    free = SamplingParams(max_tokens=16, temperature=0.0)
    thinking = SamplingParams(max_tokens=16, temperature=0.0, structured_output=PERSON_SPEC)
    spec_engine.add_request("free", prompt, free)
    spec_engine.add_request("thinking", prompt, thinking)
    spec_engine._seqs["thinking"].in_thinking_phase = True
    done = {}
    while spec_engine.has_unfinished_requests():
        for out in spec_engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
    assert done["thinking"] == done["free"]
    assert not tokenizer.decode(done["free"]).startswith("{")


def test_ignore_eos_rows_end_with_their_grammar(plain_engine, tokenizer):
    prompt = chat_ids(tokenizer, "Give me a phone number.")
    params = SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, structured_output=PHONE_SPEC
    )
    out = run(plain_engine, {"phone": (prompt, params)})["phone"]
    assert re.fullmatch(PHONE, tokenizer.decode(out, skip_special_tokens=True))
    assert out[-1] == tokenizer.eos_token_id


def test_ignore_eos_rows_go_on_past_eos_while_thinking(plain_engine, tokenizer):
    """EOS forced by a logit bias: before the thinking marker the grammar is not yet on, so
    ignore_eos holds and the row runs to max_tokens (it ended at the first EOS once)."""
    prompt = chat_ids(tokenizer, "Give me a phone number.")
    eos = tokenizer.eos_token_id
    spec = StructuredOutput("regex", PHONE, thinking_end="</think>")
    params = SamplingParams(
        max_tokens=6, temperature=0.0, ignore_eos=True, structured_output=spec,
        logit_bias={eos: 100.0},
    )  # fmt: skip
    plain_engine.add_request("thinking", prompt, params)
    finished = []
    while plain_engine.has_unfinished_requests():
        finished += [out for out in plain_engine.step() if out.finished]
    [out] = finished
    assert (out.token_ids, out.finish_reason) == ([eos] * 6, "length")


def test_prefill_here_decode_there_rebuilds_the_grammar(outputs, spec_engine):
    """The disaggregated path on one engine: a prefill-only request samples the first
    token under the grammar and drafts; blocks copied into a reserved request whose
    grammar is rebuilt from its tokens decode the same output as one engine."""
    reqs, _, spec = outputs
    engine = spec_engine
    for rid in ("phone_sampled",):
        prompt, params = reqs[rid]
        engine.add_request("p-" + rid, prompt, params, is_prefill_only=True)
        while engine.has_unfinished_requests():
            engine.step()
        done = engine.take_prefilled("p-" + rid)
        assert done is not None
        table, _ = engine.reserve("d-" + rid, prompt, params)
        for pool in engine.kv_pools.values():
            for k, v in pool.layers:
                k[table] = k[done.block_table]
                v[table] = v[done.block_table]
        engine.drop_request("p-" + rid)
        first = engine.start_decoding("d-" + rid, done.first_token, done.draft_token_ids)
        out = drain_joined(engine, [first])["d-" + rid]
        assert out.finish_reason == "stop" and out.token_ids == spec[rid]

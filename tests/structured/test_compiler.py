"""Constraints compile once per spec and tokenizer (a bounded cache), refuse what does not
compile or not in time naming the field, and build masks position by position."""

from __future__ import annotations

import itertools

import pytest
import torch

from engine.sampling_params import GrammarError, StructuredOutput
from engine.spec.drafters import DraftLogits
from engine.spec.grammar import StepGrammar
from engine.structured.bitmask import apply_bitmask
from engine.structured.compiler import GrammarCompiler
from engine.structured.rows import RowGrammar, verify_bitmask
from tests.structured.conftest import PERSON_SPEC, PHONE_SPEC

VOCAB = 49152
EOS = 2


@pytest.fixture(scope="module")
def compiler(tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, VOCAB, [EOS], cache_size=2)


def allowed(mask: torch.Tensor) -> set[int]:
    ids = torch.arange(VOCAB)
    return set(ids[((mask[ids // 32] >> (ids % 32)) & 1) == 1].tolist())


def test_specs_are_checked_before_compiling():
    with pytest.raises(GrammarError, match=r"^structured_output.json_schema: is not valid JSON"):
        StructuredOutput("json_schema", "{nope")
    with pytest.raises(GrammarError, match="must be a JSON object"):
        StructuredOutput("json_schema", "[1]")
    with pytest.raises(GrammarError, match=r"structured_output\.regex: is empty"):
        StructuredOutput("regex", "")
    with pytest.raises(GrammarError, match="kind 'xml'"):
        StructuredOutput("xml", "x")


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (StructuredOutput("json_schema", '{"type": "nope"}'), 'Unsupported type "nope"'),
        (StructuredOutput("regex", "[a-"), "structured_output.regex: Regex parsing error"),
        (StructuredOutput("grammar", "root ::= undefined_rule"), "structured_output.grammar: "),
    ],
)
def test_what_does_not_compile_is_refused_naming_it(compiler, spec, message):
    with pytest.raises(GrammarError, match=f"^{spec.field}: .*") as info:
        compiler.compile(spec)
    assert message in str(info.value)
    assert "\n" not in str(info.value) and ".cc:" not in str(info.value)


def test_compiled_once_and_the_cache_is_bounded(compiler):
    before = compiler.num_compiled
    first = compiler.compile(PHONE_SPEC)
    assert compiler.compile(PHONE_SPEC) is first
    assert compiler.num_compiled == before + 1
    compiler.compile(StructuredOutput("regex", "a+"))
    compiler.compile(StructuredOutput("regex", "b+"))  # evicts PHONE_SPEC (size 2)
    assert compiler.compile(PHONE_SPEC) is not first
    assert compiler.num_compiled == before + 4


def test_a_slow_compile_is_refused(tokenizer):
    slow = GrammarCompiler(tokenizer, VOCAB, [EOS], timeout_s=1e-4)
    with pytest.raises(GrammarError, match=r"did not compile within 0.0001 s"):
        slow.compile(PERSON_SPEC)


def test_verify_mask_position_i_is_the_state_after_i_drafts(compiler, tokenizer):
    row = RowGrammar(compiler.matcher(PHONE_SPEC), VOCAB)
    drafts = tokenizer.encode("(555", add_special_tokens=False)
    mask = verify_bitmask([row, None], [drafts, [0] * len(drafts)], VOCAB)
    assert mask is not None and mask.shape == (2, len(drafts) + 1, (VOCAB + 31) // 32)
    assert (mask[1] == -1).all()  # no grammar: everything allowed
    replay = RowGrammar(compiler.matcher(PHONE_SPEC), VOCAB)
    for i in range(len(drafts) + 1):
        expected = torch.zeros((VOCAB + 31) // 32, dtype=torch.int32)
        replay.fill(expected)
        assert torch.equal(mask[0, i], expected)
        if i < len(drafts):
            assert drafts[i] in allowed(expected)
            assert replay.try_advance(drafts[i])
    assert row.matcher.accept_token(drafts[0])  # rolled back: still at the start


def test_drafts_are_masked_state_by_state_and_rolled_back(compiler):
    row = RowGrammar(compiler.matcher(PERSON_SPEC), VOCAB)
    grammar = StepGrammar([None, row])
    start = torch.zeros((VOCAB + 31) // 32, dtype=torch.int32)
    row.fill(start)
    gen = torch.Generator().manual_seed(0)
    for _ in range(4):
        scores = DraftLogits(torch.randn(2, VOCAB, generator=gen))
        masked = grammar.mask(scores)
        assert torch.equal(masked.values[0], scores.values[0])  # the free row
        chosen = masked.argmax()
        assert row.matcher.accept_token(int(chosen[1])) and row.matcher.rollback(1) is None
        grammar.advance(chosen)
    grammar.end_drafts()
    again = torch.zeros_like(start)
    row.fill(again)  # back at the start
    assert torch.equal(again, start) and not torch.equal(start, torch.full_like(start, -1))


def test_apply_bitmask_matches_a_bit_by_bit_reference():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 2, 100, generator=gen)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, 2, 4), dtype=torch.int32, generator=gen)
    expected = logits.clone()
    for b, s, v in itertools.product(range(3), range(2), range(100)):
        if not (int(bitmask[b, s, v // 32]) >> (v % 32)) & 1:
            expected[b, s, v] = float("-inf")
    assert torch.equal(apply_bitmask(logits, bitmask), expected)

"""Grammar rows without a model: the thinking phase (``thinking_end``) tracked token by
token and rolled back, masks applied to the rows that have one only, and the marker
carried from the OpenAI body and the wire to the engine, refused where malformed."""

from __future__ import annotations

import pytest
import torch

from engine.sampling_params import GrammarError, StructuredOutput
from engine.spec.drafters import DraftLogits
from engine.spec.grammar import StepGrammar
from engine.structured.bitmask import apply_bitmask, apply_bitmask_rows
from engine.structured.compiler import GrammarCompiler
from engine.structured.rows import ALL_ALLOWED, RowGrammar, fill_verify_bitmask, num_words
from router.http_api.convert import structured_output
from router.http_api.protocol import ChatCompletionRequest, HttpError
from router.validation import ValidationError, check_structured_output
from serving.sampling import structured_from_proto
from tandem.v1 import generation_pb2 as gen
from tandem_client.request import structured_output as sdk_structured_output

VOCAB = 49152
EOS = 2
W = num_words(VOCAB)
MARKER = (7, 8, 7, 9)  # a marker whose prefix repeats: partial matches restart correctly


@pytest.fixture(scope="module")
def compiler(tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, VOCAB, [EOS])


@pytest.fixture
def row(compiler, tokenizer) -> RowGrammar:
    return RowGrammar(compiler.matcher(StructuredOutput("regex", "(yes|no)")), VOCAB, MARKER)


def mask_of(row: RowGrammar) -> torch.Tensor:
    out = torch.zeros(W, dtype=torch.int32)
    row.fill(out)
    return out


def test_thinking_ends_with_the_whole_marker(row):
    row.commit([7, 8, 7, 8, 7])  # "7 8 7" then "8 7": the marker's prefix twice, not it
    assert row.is_thinking and not row.is_masking
    assert (mask_of(row) == ALL_ALLOWED).all()  # free while thinking
    row.commit([9])  # ... 8 7 + 9: the marker ends "7 8 7 9"
    assert not row.is_thinking and row.is_masking
    assert not (mask_of(row) == ALL_ALLOWED).all()


def test_rollback_restores_the_thinking_phase(row, tokenizer):
    yes = tokenizer.encode("yes", add_special_tokens=False)
    row.commit([7, 8])
    tokens = [7, 9, *yes]  # the marker's end, then the grammar's tokens
    assert all(row.try_advance(t) for t in tokens)
    assert not row.is_thinking and row.is_terminated is False
    row.rollback(len(tokens))
    assert row.is_thinking
    row.commit([7, 9])  # committed "7 8" + "7 9": now out of the thinking phase
    assert not row.is_thinking and not row.try_advance(7)  # the grammar forbids it


def test_verify_masks_switch_on_after_the_marker_within_the_drafts(row):
    row.commit([7, 8, 7])
    out = torch.full((2, 4, W), ALL_ALLOWED, dtype=torch.int32)
    masked = fill_verify_bitmask([None, row], [[0, 0, 0], [9, 5, 5]], out)
    # Row 1: positions 0 and 1 think (the marker ends with draft 1), position 2 is masked;
    # draft 2 (5) is refused by the grammar, so position 3 is never reached.
    assert masked == [1 * 4 + 1]
    assert (out[0] == ALL_ALLOWED).all() and (out[1, 0] == ALL_ALLOWED).all()
    assert not (out[1, 1] == ALL_ALLOWED).all() and (out[1, 2:] == ALL_ALLOWED).all()
    assert row.is_thinking  # rolled back


def test_masks_touch_only_their_rows():
    gen_ = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 100, generator=gen_)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (4, 4), dtype=torch.int32, generator=gen_)
    out = logits.clone()
    apply_bitmask_rows(out, bitmask, [1, 3])
    expected = apply_bitmask(logits[:, None], bitmask[:, None])[:, 0]
    assert torch.equal(out[[1, 3]], expected[[1, 3]]) and torch.equal(out[[0, 2]], logits[[0, 2]])
    apply_bitmask_rows(out, bitmask, [])  # nothing to mask: nothing read or written
    assert torch.equal(out[[0, 2]], logits[[0, 2]])


def test_draft_scores_of_thinking_rows_are_not_masked(row):
    scores = DraftLogits(torch.randn(2, VOCAB))
    grammar = StepGrammar([None, row])
    assert grammar.mask(scores) is scores  # no row forbids anything yet
    grammar.advance(torch.tensor([0, 7]))
    for token in (8, 7, 9):
        grammar.advance(torch.tensor([0, token]))
    masked = grammar.mask(scores)  # the marker was drafted: the grammar now applies
    assert torch.equal(masked.values[0], scores.values[0])
    assert torch.isinf(masked.values[1]).sum() > VOCAB // 2
    grammar.end_drafts()
    assert row.is_thinking


def test_the_marker_travels_from_the_body_and_the_wire_to_the_engine():
    body = ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "x"}],
            "guided_regex": "a+",
            "thinking_end": "</think>",
        }
    )
    message = gen.SamplingParams()
    constraint = structured_output(body)
    assert constraint is not None
    message.structured_output.CopyFrom(constraint)
    check_structured_output(message.structured_output)
    assert structured_from_proto(message) == StructuredOutput("regex", "a+", "</think>")
    sdk = sdk_structured_output({"regex": "a+", "thinking_end": "</think>"})
    assert sdk == message.structured_output
    with pytest.raises(TypeError, match="a dict of one of"):
        sdk_structured_output({"thinking_end": "</think>"})


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"thinking_end": "</think>"}, "thinking_end: needs a constraint"),
        ({"guided_regex": "a", "thinking_end": ""}, "thinking_end: is empty"),
        ({"guided_regex": "a", "thinking_end": "x" * 65}, "thinking_end: at most 64 characters"),
    ],
)
def test_a_bad_marker_in_the_body_is_400_naming_it(extra, message):
    body = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "x"}], **extra}
    )
    with pytest.raises(HttpError) as info:
        structured_output(body)
    assert info.value.status == 400 and message in str(info.value.message)


def test_a_bad_marker_on_the_wire_is_refused_naming_it():
    too_long = gen.StructuredOutput(regex="a", thinking_end="x" * 65)
    with pytest.raises(ValidationError, match=r"structured_output.thinking_end: at most 64"):
        check_structured_output(too_long)
    with pytest.raises(ValidationError, match="structured_output: set one of"):
        check_structured_output(gen.StructuredOutput(thinking_end="</think>"))
    with pytest.raises(GrammarError, match=r"structured_output.thinking_end: at most 64"):
        StructuredOutput("regex", "a", "x" * 65)


def test_greedy_drafts_are_the_masked_argmax(compiler, tokenizer):
    """Only refused argmaxes pay for a mask, and the drafts are those of masking all."""
    spec = StructuredOutput("regex", "(yes|no)")
    rows = [RowGrammar(compiler.matcher(spec), VOCAB) for _ in range(3)]
    grammar = StepGrammar([rows[0], None, rows[1], rows[2]])
    scores = DraftLogits(torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(2)))
    allowed = tokenizer.encode("yes", add_special_tokens=False)[0]
    scores.values[2, allowed] = 100.0  # row 2's argmax is allowed: no mask
    expected = grammar.mask(scores).argmax()
    assert torch.equal(grammar.argmax(scores), expected) and int(expected[2]) == allowed
    assert rows[0].allows(int(expected[0])) and not rows[0].allows(int(scores.argmax()[0]))

"""Greedy rows without logprobs are checked argmax first: their mask is filled only where
the grammar refuses the argmax (after penalties), and the token is the one full masking
gives, ties included; sampled rows, rows with logprobs (and, when verifying drafts, rows
with penalties) still get every mask. The same on the speculative path, position by
position, and in the engine: greedy tokens with logprobs (every mask) equal those
without (argmax first), with fewer masks filled."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engine.sampler import SamplingTensors, sample
from engine.sampling_params import SamplingParams, StructuredOutput
from engine.spec.acceptance import accept
from engine.spec.grammar import StepGrammar
from engine.structured.bitmask import apply_bitmask_rows
from engine.structured.compiler import GrammarCompiler
from engine.structured.rows import RowGrammar, SamplingMasks, mask_logits
from tests.engine.test_smollm2_equality import chat_ids
from tests.structured.conftest import PERSON_SPEC, PHONE_SPEC

VOCAB = 49152
EOS = 2
YES_NO = StructuredOutput("regex", "(yes|no)")


@pytest.fixture(scope="module")
def compiler(tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, VOCAB, [EOS])


@pytest.fixture
def fills(monkeypatch) -> list[RowGrammar]:
    """The rows whose mask is filled, once per fill."""
    filled: list[RowGrammar] = []
    fill = RowGrammar.fill

    def counted(row: RowGrammar, out: torch.Tensor) -> None:
        filled.append(row)
        fill(row, out)

    monkeypatch.setattr(RowGrammar, "fill", counted)
    return filled


def token(tokenizer, text: str) -> int:
    (only,) = tokenizer.encode(text, add_special_tokens=False)
    return only


def test_a_refused_argmax_takes_the_full_mask_and_gives_its_token(compiler, tokenizer, fills):
    yes, refused = token(tokenizer, "yes"), token(tokenizer, "x")
    before, after = 0, VOCAB - 1  # refused ids around "yes", for ties
    probe = RowGrammar(compiler.matcher(YES_NO), VOCAB)
    assert probe.allows(yes) and not any(probe.allows(t) for t in (refused, before, after))
    greedy = SamplingParams(temperature=0.0)
    params = [
        greedy,  # 0: random logits, the argmax refused
        greedy,  # 1: the argmax allowed
        greedy,  # 2: no grammar
        SamplingParams(temperature=1.0, seed=3),  # 3: sampled
        SamplingParams(temperature=0.0, logprobs=1),  # 4: logprobs
        SamplingParams(temperature=0.0, logit_bias={refused: 100.0}),  # 5: bias refuses it
        greedy,  # 6: "yes" tied with a refused id after it: the first maximum is allowed
        greedy,  # 7: "yes" tied with a refused id before it
    ]
    rows: list[RowGrammar | None] = [RowGrammar(compiler.matcher(YES_NO), VOCAB) for _ in params]
    rows[2] = None
    raw = torch.randn(len(params), VOCAB, generator=torch.Generator().manual_seed(4))
    raw[1, yes] = 100.0
    raw[5, yes] = 50.0  # the argmax before the bias, allowed; after it, ``refused`` wins
    raw[6, yes] = raw[6, after] = 100.0
    raw[7, before] = raw[7, yes] = 100.0
    tensors = SamplingTensors.build(
        params, [p.seed or 0 for p in params], [4] * 8, raw.device, [[5, 6]] * 8, [1] * 8
    )
    expected = sample(mask_logits(rows, raw.clone()), tensors)  # every row masked first
    fills.clear()

    masks = SamplingMasks(rows, None, params)
    assert masks.masked == [3, 4] and masks.argmax_first == [0, 1, 5, 6, 7]
    logits = masks.apply(raw.clone())
    assert fills == [rows[3], rows[4]]  # before sampling
    tokens = sample(logits, tensors, masks=masks)
    assert torch.equal(tokens, expected)
    assert [rows.index(row) for row in fills[2:]] == [0, 5, 7]  # refused: filled
    assert int(raw[0].argmax()) != int(tokens[0])  # the refused argmax was replaced
    assert tokens[[1, 5, 6, 7]].tolist() == [yes] * 4


def verify_logits(tokenizer, drafts: list[int]) -> torch.Tensor:
    """[6, K+1, V]: per row, which positions the target's argmax is a draft or refused."""
    k = len(drafts)
    refused = token(tokenizer, "x")
    logits = torch.randn(6, k + 1, VOCAB, generator=torch.Generator().manual_seed(5))
    d = drafts
    # Row 0: accepts d0 and d1, then refuses at 2, where the masked argmax is "7", not d2.
    logits[0, 0, d[0]] = logits[0, 1, d[1]] = logits[0, 2, refused] = 100.0
    logits[0, 2, token(tokenizer, "7")] = 50.0
    # Row 1: refused at 0 with d0 the best allowed: accepted through the mask; d1, d2 are
    # the argmax; the bonus position refused.
    logits[1, 0, refused], logits[1, 0, d[0]] = 100.0, 50.0
    logits[1, 1, d[1]] = logits[1, 2, d[2]] = logits[1, 3, refused] = 100.0
    # Rows 2 to 5: as row 1.
    logits[2:] = logits[1]
    return logits


def test_verify_masks_are_filled_where_greedy_rows_refuse_the_argmax(compiler, tokenizer):
    drafts = tokenizer.encode("(555", add_special_tokens=False)[:3]
    assert len(drafts) == 3 and token(tokenizer, "7") not in drafts
    s = len(drafts) + 1
    greedy = SamplingParams(temperature=0.0)
    params = [
        greedy,  # 0, 1: argmax first
        greedy,
        SamplingParams(temperature=0.0, logprobs=1),  # every position masked
        SamplingParams(temperature=0.8, seed=1),  # sampled: every position
        SamplingParams(temperature=0.0, repetition_penalty=1.2),  # penalties: every one
        greedy,  # 5: drafts the grammar refuses
    ]
    rows = [RowGrammar(compiler.matcher(PHONE_SPEC), VOCAB) for _ in params]
    seqs = [
        SimpleNamespace(params=p, grammar=r, in_thinking_phase=False)
        for p, r in zip(params, rows, strict=True)
    ]
    row_drafts = [drafts] * 5 + [[token(tokenizer, "x"), *drafts[1:]]]
    logits = verify_logits(tokenizer, drafts)
    logits[5, 0, row_drafts[5][0]] = 100.0  # row 5's refused draft is the argmax

    def verify(grammar: StepGrammar | None) -> tuple[list[int], torch.Tensor, torch.Tensor]:
        """The positions masked, and greedy acceptance of the masked logits."""
        assert grammar is not None
        grammar.start_verify(row_drafts)
        bitmask, masked = grammar.verify_mask(logits)
        out = logits.clone()
        apply_bitmask_rows(out.view(6 * s, -1), bitmask.view(6 * s, -1), masked)
        sampling = SamplingTensors.build([greedy] * 6, [0] * 6, [0] * 6, logits.device)
        first_positions = torch.zeros(6, dtype=torch.int64)
        num, next_tokens = accept(out, torch.tensor(row_drafts), sampling, first_positions)
        return masked, num, next_tokens

    every_mask = verify(StepGrammar(rows))
    argmax_first = verify(StepGrammar.of(seqs))
    assert torch.equal(argmax_first[1], every_mask[1])
    assert torch.equal(argmax_first[2], every_mask[2])
    assert every_mask[0] == [*range(5 * s), 5 * s]  # row 5 stops at its refused draft
    assert argmax_first[0] == [2, 4, 7, *range(2 * s, 5 * s), 5 * s]
    assert argmax_first[1][:2].tolist() == [2, 3]  # row 1 accepted d0 through its mask
    assert int(argmax_first[2][0]) == token(tokenizer, "7")
    assert argmax_first[1][5] == 0 and argmax_first[2][5] != row_drafts[5][0]
    assert all(row.matcher.accept_token(drafts[0]) for row in rows)  # rolled back


@pytest.mark.slow  # SmolLM2 fp32 (the shared engines): 7 min on a heavily loaded 2-core VM
def test_engine_tokens_with_every_mask_and_argmax_first_are_the_same(
    plain_engine, spec_engine, tokenizer, fills
):
    prompts = {
        "person": (chat_ids(tokenizer, "Describe a person as JSON."), PERSON_SPEC),
        "phone": (chat_ids(tokenizer, "Give me a phone number."), PHONE_SPEC),
    }
    for engine in (plain_engine, spec_engine):
        outputs: dict[str, list[int]] = {}
        num_fills: dict[str, int] = {}
        for logprobs in (1, None):
            for name, (prompt, spec) in prompts.items():
                params = SamplingParams(
                    max_tokens=48, temperature=0.0, logprobs=logprobs, structured_output=spec
                )
                rid = f"{name}-{logprobs}"
                engine.add_request(rid, prompt, params)
            fills.clear()
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        outputs[out.request_id] = out.token_ids
            num_fills[str(logprobs)] = len(fills)
        for name in prompts:
            assert outputs[f"{name}-1"] == outputs[f"{name}-None"], name
            assert outputs[f"{name}-None"][-1] == tokenizer.eos_token_id
        assert num_fills["None"] < num_fills["1"], num_fills

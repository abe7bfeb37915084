"""Greedy generation with logit bias and penalties equals a reference loop over
transformers' logits: its RepetitionPenaltyLogitsProcessor, and OpenAI's frequency and
presence penalties by hand (transformers has no processor for them); each setting changes
what plain greedy generates."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from engine.llm_engine import EngineConfig, LLMEngine, RequestError
from engine.sampling_params import SamplingParams
from tests.comparator import compare_greedy
from tests.engine.tiny_models import build_tiny_llama

PROMPTS = [[5, 6, 7], [9] * 11, [3, 4, 8, 8, 1], [10, 11, 12, 13, 14, 15, 16]]
NUM_TOKENS = 16
SETTINGS = {
    "frequency": dict(frequency_penalty=1.2),
    "presence": dict(presence_penalty=2.0),
    "repetition": dict(repetition_penalty=1.8),
    "rewards": dict(frequency_penalty=-0.8, presence_penalty=0.3, repetition_penalty=0.7),
    "bias": dict(logit_bias={0: 5.0, 1: -100.0, 2: -100.0}),
    "all": dict(
        frequency_penalty=0.5,
        presence_penalty=0.5,
        repetition_penalty=1.3,
        logit_bias={4: 3.0, 8: -2.0},
    ),
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):
    out = tmp_path_factory.mktemp("penalties")
    model = build_tiny_llama(out, "gqa3_llama3rope_tied_bias_hd40", num_layers=2, vocab_size=64)
    engine = LLMEngine(
        EngineConfig(model=str(out), dtype="float32", kv_cache_memory=1 << 21, block_size=4)
    )
    return engine, model


def generate(engine: LLMEngine, params: SamplingParams) -> list[list[int]]:
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
    return [done[str(i)] for i in range(len(PROMPTS))]


def adjusted(params: SamplingParams):
    """The reference's logits as greedy sees them: bias, transformers' repetition
    processor over prompt and output, then frequency and presence by hand."""
    processor = RepetitionPenaltyLogitsProcessor(params.repetition_penalty)

    def adjust(prompt: list[int], output: list[int], logits: torch.Tensor) -> torch.Tensor:
        x = logits.clone()
        for token, bias in params.bias_pairs:
            x[token] += bias
        x = processor(torch.tensor([prompt + output]), x[None])[0]
        for token, n in Counter(output).items():
            x[token] -= params.frequency_penalty * n + params.presence_penalty
        return x

    return adjust


def reference_greedy(model: torch.nn.Module, params: SamplingParams) -> list[list[int]]:
    adjust = adjusted(params)
    rows = []
    for prompt in PROMPTS:
        output: list[int] = []
        for _ in range(NUM_TOKENS):
            ids = torch.tensor([prompt + output])
            with torch.inference_mode():
                logits = model(ids, attention_mask=torch.ones_like(ids)).logits[0, -1].float()
            output.append(int(adjust(prompt, output, logits).argmax()))
        rows.append(output)
    return rows


@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_greedy_with_penalties_equals_the_reference(tiny, setting):
    engine, model = tiny
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)
    plain = generate(engine, params)
    penalized = SamplingParams(**{**params.__dict__, **SETTINGS[setting]})
    ours = generate(engine, penalized)
    assert ours != plain  # the setting changes the output
    refs = reference_greedy(model, penalized)
    result = compare_greedy(model, PROMPTS, ours, refs, adjust=adjusted(penalized))
    assert result.num_ties <= 1


def test_frequency_penalty_stops_a_repeat(tiny):
    """Where plain greedy repeats a token, a frequency penalty large enough does not."""
    engine, _ = tiny
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)
    plain = generate(engine, params)
    assert any(len(set(row)) < len(row) for row in plain)
    strong = SamplingParams(**{**params.__dict__, "frequency_penalty": 2.0})
    penalized = generate(engine, strong)
    assert any(len(set(row)) > len(set(p)) for row, p in zip(penalized, plain, strict=True))


def test_a_bias_outside_the_vocabulary_is_refused(tiny):
    engine, _ = tiny
    with pytest.raises(RequestError, match=r"^logit_bias: token id 64 is outside the vocab"):
        engine.add_request("x", [1, 2], SamplingParams(logit_bias={3: 1.0, 64: 1.0}))
    assert not engine.has_unfinished_requests()

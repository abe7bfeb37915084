"""Greedy losslessness on SmolLM2-135M in fp32: with every drafter and K in {1, 3, 5}
(DFlash: its block), a mixed batch of 8 chat prompts x 64 tokens equals target-only
decoding token for token (tie-aware). Uses the committed SmolLM2 drafts when present,
else random drafts of the same layouts (lossless either way; acceptance differs)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, LlamaForCausalLM

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from engine.spec.config import SpeculativeConfig
from tests.comparator import compare_greedy
from tests.engine.test_smollm2_equality import QUESTIONS, chat_ids
from tests.engine.tiny_drafts import build_random_draft

NEW_TOKENS = 64
COMMITTED = Path(__file__).resolve().parents[3] / "drafts" / "smollm2"


def draft_dir(kind: str, smollm2_dir: Path, tmp: Path) -> Path:
    if (COMMITTED / kind / "config.json").is_file():
        return COMMITTED / kind
    return build_random_draft(smollm2_dir, tmp / kind, kind, std=0.02, intermediate_size=256)


@pytest.fixture(scope="module")
def setup(smollm2_dir, tmp_path_factory):
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    prompts = [chat_ids(tokenizer, q) for q in QUESTIONS]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    llm = LLM(str(smollm2_dir), dtype="float32", kv_cache_memory=256 << 20)
    base = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    return prompts, params, base, tmp_path_factory.mktemp("drafts")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("kind", "k"),
    [
        ("eagle", 1),  # K at its edges: 1 and 5 (the suite's time budget)
        ("eagle", 5),
        ("eagle3", 1),
        ("eagle3", 5),
        ("dflash", None),
    ],
)
def test_spec_greedy_equals_target_only(smollm2_dir, setup, kind, k):
    prompts, params, base, tmp = setup
    draft = draft_dir(kind, smollm2_dir, tmp)
    spec = SpeculativeConfig(str(draft), num_draft_tokens=k or 5)
    llm = LLM(str(smollm2_dir), dtype="float32", kv_cache_memory=256 << 20, speculative=spec)
    ours = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    stats = llm.engine.spec.stats  # type: ignore[union-attr]
    assert stats.num_draft_tokens > 0
    if ours != base:
        model = LlamaForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
        result = compare_greedy(model, prompts, ours, base)
        assert result.num_ties <= 1, f"too many ties to trust: {result.tie_positions}"


@pytest.mark.slow
def test_stop_string_inside_a_step_ends_where_target_only_ends(smollm2_dir, setup):
    """A stop string completed by a token in the middle of a step's emitted tokens: the
    text and tokens end exactly where target-only decoding ends them."""
    prompts, _, base, tmp = setup
    llm = LLM(str(smollm2_dir), dtype="float32", kv_cache_memory=256 << 20)
    text = llm.tokenizer.decode(base[1], skip_special_tokens=True)
    stop = text[len(text) // 2 : len(text) // 2 + 6]  # six characters mid-answer
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, stop=[stop], ignore_eos=True)
    plain = llm.generate([prompts[1]], params, use_tqdm=False)[0]
    spec = SpeculativeConfig(str(draft_dir("eagle3", smollm2_dir, tmp)), num_draft_tokens=5)
    llm_spec = LLM(str(smollm2_dir), dtype="float32", kv_cache_memory=256 << 20, speculative=spec)
    ours = llm_spec.generate([prompts[1]], params, use_tqdm=False)[0]
    assert (plain.finish_reason, plain.stop_reason) == ("stop", stop)
    assert (ours.text, ours.token_ids) == (plain.text, plain.token_ids)
    assert (ours.finish_reason, ours.stop_reason) == ("stop", stop)

"""Sampled losslessness with EAGLE-3 drafts of a DeepSeek-V3 target: the joint of the
first three sampled tokens equals target-only sampling (the chi-square test Llama-3's
drafters pass), for the MHA and the MLA draft."""

from __future__ import annotations

import pytest
import torch

from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.spec.config import SpeculativeConfig
from tests.engine.spec.test_eagle3_deepseek_v3 import MHA_OVERRIDES
from tests.engine.spec.test_spec_sampled import PROMPT, VOCAB, chi_square_p, engine_for, exact_joint
from tests.engine.tiny_deepseek import build_tiny_deepseek
from tests.engine.tiny_drafts import build_random_draft

# A quarter of Llama-3's 20 000 samples: the MoE runs its experts one by one. (That the test
# catches a lossy rule is shown on Llama-3, tests/engine/spec/test_spec_sampled.py.)
NUM_SAMPLES = 5_000


def sample_joint(engine: LLMEngine, params: SamplingParams, num_samples: int) -> torch.Tensor:
    """Counts of the first three tokens over ``num_samples`` seeds: [V, V, V]."""
    counts = torch.zeros(VOCAB, VOCAB, VOCAB)
    for seed in range(num_samples):
        engine.add_request(str(seed), PROMPT, SamplingParams(**{**params.__dict__, "seed": seed}))
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                counts[tuple(out.token_ids)] += 1
    return counts


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["mha", "mla"])
def test_joint_of_three_tokens_matches_the_deepseek_target_alone(tmp_path, variant):
    hf_model = build_tiny_deepseek(
        tmp_path / "t", "q_proj_plain_rope_split_tied_bias", vocab_size=VOCAB, num_layers=2
    )
    # The MHA draft: one K/V head of 16 for the target's 3 query heads.
    overrides = {**MHA_OVERRIDES, "num_key_value_heads": 1} if variant == "mha" else {}
    eagle = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2]}}
    draft = build_random_draft(
        tmp_path / "t", tmp_path / "d", "eagle3", std=0.3, **{**overrides, **eagle}
    )
    # top-k 6: 216 cells of a few dozen samples each (this target's logits are flat, and
    # over all 4096 cells most would hold fewer than the test's 5).
    params = SamplingParams(max_tokens=3, ignore_eos=True, temperature=0.7, top_k=6)
    exact = exact_joint(hf_model, params)
    spec = SpeculativeConfig(str(draft), num_draft_tokens=2, sample_drafts=True)
    engine = engine_for(tmp_path / "t", spec)
    counts = sample_joint(engine, params, NUM_SAMPLES)
    assert engine.spec is not None and 0 < engine.spec.stats.acceptance_rate < 1
    assert chi_square_p(counts, exact) > 1e-3

"""Sampled losslessness: the joint distribution of the first three generated tokens with
speculation equals target-only sampling (chi-square against the exact distribution,
enumerated with transformers; logit bias and penalties by a plain reference), for model
drafts and suffix decoding's, and a wrong rule that accepts every draft fails the test."""

from __future__ import annotations

import itertools

import pytest
import torch
from scipy.stats import chi2

from engine.llm_engine import EngineConfig, LLMEngine
from engine.sampler import SamplingTensors, filtered_probs
from engine.sampling_params import SamplingParams
from engine.spec.config import SpeculativeConfig
from engine.spec.suffix import SuffixConfig
from tests.engine.penalty_reference import reference_penalized
from tests.engine.spec.test_spec_greedy import markov_target
from tests.engine.tiny_drafts import build_random_draft
from tests.engine.tiny_models import build_tiny_llama

VOCAB = 16
PROMPT = [3, 1, 4, 1, 5]
NUM_SAMPLES = 20_000
SETTINGS = {
    "t1.0": dict(temperature=1.0),
    "t0.7_topk6": dict(temperature=0.7, top_k=6),
    "t1.0_topp0.8": dict(temperature=1.0, top_p=0.8),
}
# Tokens 2 and 3 count the first (and second) as output, and verification must count the
# drafts before each position likewise.
PENALTIES = dict(
    temperature=1.0,
    top_k=12,
    frequency_penalty=1.5,
    presence_penalty=0.5,
    repetition_penalty=1.4,
    logit_bias={0: 2.0, 6: -100.0},
)


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory):
    out = tmp_path_factory.mktemp("sampled")
    model = build_tiny_llama(out / "target", "mha_plain", num_layers=2, vocab_size=VOCAB)
    draft = build_random_draft(out / "target", out / "eagle", "eagle", std=0.3)
    return out / "target", draft, model


def exact_joint(model: torch.nn.Module, params: SamplingParams) -> torch.Tensor:
    """P(t1, t2, t3) of target-only sampling under ``params``: [V, V, V]."""

    def probs(prefixes: list[list[int]]) -> torch.Tensor:
        ids = torch.tensor([PROMPT + p for p in prefixes])
        with torch.inference_mode():
            logits = model(ids, attention_mask=torch.ones_like(ids)).logits[:, -1].float()
        rows = zip(logits, prefixes, strict=True)
        logits = torch.stack([reference_penalized(x, PROMPT, p, params) for x, p in rows])
        n = len(prefixes)
        # Built without the rows' tokens: the sampler adds no penalties of its own.
        t = SamplingTensors.build([params] * n, [0] * n, [0] * n, torch.device("cpu"))
        return filtered_probs(logits, t)  # [n, V]

    p1 = probs([[]])[0]  # [V]
    p2 = probs([[a] for a in range(VOCAB)])  # [V, V]
    p3 = probs([[a, b] for a, b in itertools.product(range(VOCAB), repeat=2)])
    return p1[:, None, None] * p2[:, :, None] * p3.view(VOCAB, VOCAB, VOCAB)


def sample_joint(engine: LLMEngine, params: SamplingParams) -> torch.Tensor:
    counts = torch.zeros(VOCAB, VOCAB, VOCAB)
    for seed in range(NUM_SAMPLES):
        engine.add_request(str(seed), PROMPT, SamplingParams(**{**params.__dict__, "seed": seed}))
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                counts[tuple(out.token_ids)] += 1
    return counts


def chi_square_p(counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """p-value of the counts under the exact distribution; cells with fewer than 5
    expected samples are pooled into one."""
    expected = expected_probs.flatten().double() * counts.sum()
    observed = counts.flatten().double()
    big = expected >= 5
    e = torch.cat([expected[big], expected[~big].sum()[None]])
    o = torch.cat([observed[big], observed[~big].sum()[None]])
    stat = float(((o - e) ** 2 / e.clamp(min=1e-12)).sum())
    return float(chi2.sf(stat, df=len(e) - 1))


def accepting_every_draft(draft) -> SpeculativeConfig:
    """Two sampled drafts, both always accepted: not lossless (a test must catch it)."""
    return SpeculativeConfig(
        str(draft),
        num_draft_tokens=2,
        sample_drafts=True,
        acceptance="synthetic",
        synthetic_acceptance_rates=(1.0, 1.0),
    )


def engine_for(model_dir, spec: SpeculativeConfig | None, dtype: str = "float32") -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=str(model_dir),
            dtype=dtype,
            block_size=4,
            kv_cache_memory=64 << 20,
            max_num_seqs=1024,
            max_num_batched_tokens=8192,
            enable_prefix_caching=False,
            speculative=spec,
        )
    )


@pytest.mark.slow
@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_joint_of_three_tokens_matches_target_only(target, setting):
    model_dir, draft, hf_model = target
    params = SamplingParams(max_tokens=3, ignore_eos=True, **SETTINGS[setting])
    exact = exact_joint(hf_model, params)
    # Sampled drafts (q is the draft's own filtered distribution): the min(1, p/q) rule.
    spec = SpeculativeConfig(str(draft), num_draft_tokens=2, sample_drafts=True)
    engine = engine_for(model_dir, spec)
    counts = sample_joint(engine, params)
    assert engine.spec is not None and engine.spec.stats.num_accepted_tokens > 0
    assert 0 < engine.spec.stats.acceptance_rate < 1
    assert chi_square_p(counts, exact) > 1e-3
    # Accepting every draft is not lossless, and the same test must say so.
    wrong = accepting_every_draft(draft)
    assert chi_square_p(sample_joint(engine_for(model_dir, wrong), params), exact) < 1e-6


def repeats(joint: torch.Tensor) -> torch.Tensor:
    """Counts or probabilities of [V, V, V] summed by which of the three tokens repeat
    (t1 == t2, t2 == t3, t1 == t3): [8], where penalties move the most mass."""
    t1, t2, t3 = torch.meshgrid(*[torch.arange(VOCAB)] * 3, indexing="ij")
    pattern = 4 * (t1 == t2).long() + 2 * (t2 == t3).long() + (t1 == t3).long()
    return torch.zeros(8, dtype=joint.dtype).scatter_add_(0, pattern.flatten(), joint.flatten())


@pytest.fixture(scope="module")
def markov(tmp_path_factory: pytest.TempPathFactory):
    return markov_target(tmp_path_factory.mktemp("sampled_markov"), vocab_size=VOCAB)


@pytest.mark.slow
def test_joint_with_penalties_and_bias_matches_target_only(markov):
    """The draft is the target itself, sampled without the penalties: most drafts are
    accepted, and each verified position must count the drafts before it as output (a rule
    that does not puts mass on repeats that top-k rules out)."""
    target_dir, draft_dir, hf_model = markov
    params = SamplingParams(max_tokens=3, ignore_eos=True, **PENALTIES)
    exact = exact_joint(hf_model, params)
    spec = SpeculativeConfig(str(draft_dir), num_draft_tokens=2, sample_drafts=True)
    engine = engine_for(target_dir, spec)
    counts = sample_joint(engine, params)
    assert engine.spec is not None and 0.3 < engine.spec.stats.acceptance_rate < 1
    assert chi_square_p(counts, exact) > 1e-3
    assert chi_square_p(repeats(counts), repeats(exact)) > 1e-3


@pytest.mark.slow
def test_joint_with_suffix_drafts_matches_target_only(target):
    """Suffix decoding's proposals are point masses: with one-token keys and each request's
    output kept for the next ones, most steps verify two drafts that earlier samples made
    likely. The same rule that accepts every draft must fail."""
    model_dir, _, hf_model = target
    params = SamplingParams(max_tokens=3, ignore_eos=True, temperature=1.0, top_k=8)
    exact = exact_joint(hf_model, params)
    matching = SuffixConfig(key_len=1, spec_factor=2.0, min_token_prob=0.0)
    spec = SpeculativeConfig("", num_draft_tokens=2, kind="suffix", suffix=matching)
    engine = engine_for(model_dir, spec)
    counts = sample_joint(engine, params)
    stats = engine.spec.stats  # type: ignore[union-attr]
    assert stats.num_drafts > NUM_SAMPLES // 2 and 0 < stats.acceptance_rate < 1
    assert chi_square_p(counts, exact) > 1e-3
    wrong = SpeculativeConfig(
        "",
        num_draft_tokens=2,
        kind="suffix",
        suffix=matching,
        acceptance="synthetic",
        synthetic_acceptance_rates=(1.0, 1.0),
    )
    assert chi_square_p(sample_joint(engine_for(model_dir, wrong), params), exact) < 1e-6

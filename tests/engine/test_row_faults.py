"""A row whose logits are not finite fails alone (finish_reason "error"), with or without
speculation; the rest of its batch goes on, token for token as without the fault. NaN
draft logits cost only acceptance."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from engine.llm_engine import EngineConfig, LLMEngine, RequestOutput
from engine.sampling_params import SamplingParams
from engine.spec.config import SpeculativeConfig
from tests.engine.tiny_drafts import build_random_draft
from tests.engine.tiny_models import build_tiny_llama

FAULT_POSITION = 16  # the victim's logits turn NaN here; the other requests never get there
INNOCENT = [[5, 6, 7], [9, 9, 9, 9, 9], [3, 4, 10, 11], [40, 41, 42, 43, 44, 45]]
VICTIM = list(range(20, 32))  # 12 tokens: its outputs 1..5 come from positions 11..15


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("fault_target")
    build_tiny_llama(out, "gqa3_llama3rope_tied_bias_hd40", num_layers=3, vocab_size=64)
    return out


@pytest.fixture(scope="module")
def eagle3(target: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_random_draft(target, tmp_path_factory.mktemp("fault_draft"), "eagle3")


def engine_for(target: Path, draft: Path | None) -> LLMEngine:
    spec = SpeculativeConfig(str(draft), num_draft_tokens=3) if draft is not None else None
    config = EngineConfig(
        model=str(target), dtype="float32", kv_cache_memory=1 << 21, block_size=4, speculative=spec
    )
    return LLMEngine(config)


def nan_at_position(model: torch.nn.Module, position: int) -> None:
    """Makes ``model``'s logits NaN at every row computed for ``position``."""

    def hook(module: Any, args: tuple[Any, ...], out: Any) -> None:
        positions, logit_indices = args[1], args[5]
        out.logits[positions[logit_indices] == position] = float("nan")

    model.register_forward_hook(hook)


def run(engine: LLMEngine, victim: SamplingParams) -> dict[str, RequestOutput]:
    for i, prompt in enumerate(INNOCENT):
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        if i % 2:  # seeded sampling beside greedy
            params = SamplingParams(max_tokens=8, temperature=0.8, seed=i, ignore_eos=True)
        engine.add_request(f"innocent-{i}", prompt, params)
    engine.add_request("victim", VICTIM, victim)
    done: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return done


@pytest.mark.parametrize("with_draft", [False, True], ids=["target-only", "eagle3"])
@pytest.mark.parametrize("victim_temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_a_row_with_nan_logits_fails_alone(
    target: Path, eagle3: Path, with_draft: bool, victim_temperature: float
) -> None:
    victim = SamplingParams(max_tokens=12, temperature=victim_temperature, seed=7, ignore_eos=True)
    draft = eagle3 if with_draft else None
    reference = run(engine_for(target, draft), victim)
    assert all(o.finish_reason == "length" for o in reference.values())

    engine = engine_for(target, draft)
    nan_at_position(engine.runner.model, FAULT_POSITION)
    faulted = run(engine, victim)
    for rid in (f"innocent-{i}" for i in range(len(INNOCENT))):
        assert faulted[rid].token_ids == reference[rid].token_ids, rid
        assert faulted[rid].finish_reason == "length"
    hit = faulted["victim"]
    assert hit.finish_reason == "error"
    num_before = FAULT_POSITION - len(VICTIM) + 1  # tokens from positions 11..15
    assert hit.token_ids == reference["victim"].token_ids[:num_before]


def test_nan_draft_logits_only_cost_acceptance(target: Path, eagle3: Path) -> None:
    victim = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    reference = run(engine_for(target, None), victim)
    engine = engine_for(target, eagle3)
    assert engine.spec is not None

    def nan_logits(module: Any, args: tuple[Any, ...], out: torch.Tensor) -> None:
        out.fill_(float("nan"))

    engine.spec.drafter.lm_head.register_forward_hook(nan_logits)  # type: ignore[union-attr]
    ours = run(engine, victim)
    assert {r: o.token_ids for r, o in ours.items()} == {
        r: o.token_ids for r, o in reference.items()
    }
    assert engine.spec.stats.num_accepted_tokens == 0

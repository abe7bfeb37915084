"""Drafts under data-parallel attention (real processes, gloo): each rank runs the whole
draft over its own rows and its own draft KV pool, rank 0 choosing every row's drafts.
With DeepSeek-V3's MTP layer and with either EAGLE-3 draft (MLA and MHA), over two
ranks with and without expert parallelism, in chunked prefill and with one rank idle,
speculative output equals the target alone, and every request is offered the drafts one
device offers it."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.dp_blocks import DataParallelBlocks
from engine.llm_engine import EngineConfig, LLMEngine
from engine.sampling_params import SamplingParams
from engine.spec.config import SpeculativeConfig
from engine.spec.dp_draft import DataParallelDrafter
from tests.engine.parallel.test_tp_deepseek_v3 import GREEDY, greedy
from tests.engine.spec.test_eagle3_deepseek_v3 import MHA_OVERRIDES
from tests.engine.tiny_deepseek import (
    build_tiny_deepseek,
    build_tiny_deepseek_with_mtp,
    make_mtp_know_the_target,
)
from tests.engine.tiny_drafts import build_random_draft

VOCAB = 97
SHAPE = "qlora_yarn_mscale_interleaved"  # 8 experts in 4 groups, q-LoRA, YaRN
CHUNKED = {"max_num_batched_tokens": 6}  # prompts in chunks: rows that propose nothing


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(6)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (4, 13, 7, 9)]


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory, prompts) -> tuple[Path, list[list[int]]]:
    """A tiny DeepSeek-V3 and its greedy output alone, on one device."""
    out = tmp_path_factory.mktemp("dp_drafts")
    build_tiny_deepseek(out, SHAPE, vocab_size=VOCAB, num_layers=3)
    alone, _ = greedy(out, prompts, 1)
    return out, alone


Offered = dict[str, list[list[int]]]  # per request, its drafts after each step


def run(
    model_dir: Path, prompts: list[list[int]], params: SamplingParams, **kw: Any
) -> tuple[list[list[int]], LLMEngine]:
    """Each prompt's output under ``params`` (``greedy``'s engine), and the engine."""
    engine = LLMEngine(
        EngineConfig(model=str(model_dir), dtype="float32", block_size=4,
                     kv_cache_memory=4 << 20, num_threads=2, **kw)
    )  # fmt: skip
    try:
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, params)
        done: dict[str, list[int]] = {}
        while engine.has_unfinished_requests():
            done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    finally:
        engine.close()
    return [done[str(i)] for i in range(len(prompts))], engine


def offered_drafts(
    model_dir: Path,
    prompts: list[list[int]],
    spec: SpeculativeConfig,
    params: SamplingParams = GREEDY,
    **kw: Any,
) -> tuple[list[list[int]], LLMEngine, Offered]:
    """The output under ``params``, the engine, and per request the drafts it held after
    each prefill and decode step."""
    offered: Offered = {}
    real_init = LLMEngine.__init__

    def recording_init(engine: LLMEngine, *args: Any, **kwargs: Any) -> None:
        real_init(engine, *args, **kwargs)
        runner = engine.spec
        assert runner is not None
        prefill, decode = runner.prefill, runner.decode

        def record(seqs: Any) -> None:
            for seq in seqs:
                if seq.draft_token_ids:
                    offered.setdefault(seq.request_id, []).append(list(seq.draft_token_ids))

        def recorded_prefill(batch: Any) -> Any:
            out = prefill(batch)
            record(batch.seqs)
            return out

        def recorded_decode(seqs: Any) -> Any:
            out = decode(seqs)
            record(seqs)
            return out

        runner.prefill, runner.decode = recorded_prefill, recorded_decode  # type: ignore[method-assign]

    LLMEngine.__init__ = recording_init  # type: ignore[method-assign]
    try:
        out, engine = run(model_dir, prompts, params, speculative=spec, **kw)
    finally:
        LLMEngine.__init__ = real_init  # type: ignore[method-assign]
    return out, engine, offered


@pytest.mark.parametrize(("variant", "expert_parallel"), [("mla", True), ("mha", False)])
def test_eagle3_drafts_beside_each_ranks_rows(target, prompts, tmp_path, variant,
                                              expert_parallel) -> None:  # fmt: skip
    model_dir, alone = target
    overrides = {k: v for k, v in MHA_OVERRIDES.items() if k != "eagle_config"}
    shape: dict[str, Any] = overrides if variant == "mha" else {}
    draft = build_random_draft(model_dir, tmp_path / "draft", "eagle3", draft_vocab_size=48,
                               d2t=torch.arange(48), **shape)  # fmt: skip
    spec = SpeculativeConfig(str(draft), num_draft_tokens=3)
    one, _, offered_one = offered_drafts(model_dir, prompts, spec, **CHUNKED)
    ours, engine, offered = offered_drafts(
        model_dir,
        prompts,
        spec,
        data_parallel_size=2,
        enable_expert_parallel=expert_parallel,
        **CHUNKED,
    )
    assert one == alone and ours == alone
    assert engine.block_manager.num_placed == [2, 2]  # type: ignore[union-attr]
    assert isinstance(engine.spec.drafter, DataParallelDrafter)  # type: ignore[union-attr]
    assert len(engine.kv_pools["draft"].layers[0]) == (2 if variant == "mha" else 1)
    # The same drafts, step by step, as one device proposes: chosen over every rank's
    # rows in the batch's order, each rank's chain on from its own rows' tokens.
    assert offered == offered_one
    assert sum(len(steps) for steps in offered.values()) >= 4 * 9  # every step drafted


def test_mtp_drafts_over_both_ranks_with_one_rank_idle(tmp_path, prompts) -> None:
    """DeepSeek-V3's own MTP layer, made to predict the target, at DP 2 with EP 2: every
    draft is accepted, as on one device. Then one request alone: rank 1 has no rows in
    any draft forward and joins each position's gather and broadcast."""
    model_dir = tmp_path / "mtp"
    build_tiny_deepseek_with_mtp(model_dir, SHAPE, vocab_size=VOCAB)
    make_mtp_know_the_target(model_dir)
    alone, _ = greedy(model_dir, prompts, 1)
    mtp = SpeculativeConfig("", kind="mtp", num_draft_tokens=3)
    one, single = greedy(model_dir, prompts, 1, speculative=mtp, **CHUNKED)
    ours, engine = greedy(model_dir, prompts, 1, speculative=mtp, data_parallel_size=2,
                          enable_expert_parallel=True, **CHUNKED)  # fmt: skip
    assert one == alone and ours == alone
    stats, expected = engine.spec.stats, single.spec.stats  # type: ignore[union-attr]
    assert stats.num_accepted_tokens == stats.num_draft_tokens == expected.num_accepted_tokens
    assert stats.num_draft_tokens > 0
    placed = engine.block_manager.num_placed  # type: ignore[union-attr]
    assert sum(placed) == 4 and min(placed) > 0  # both ranks draft
    ours, engine = greedy(model_dir, prompts[1:2], 1, speculative=mtp, data_parallel_size=2,
                          enable_expert_parallel=True, **CHUNKED)  # fmt: skip
    assert ours == alone[1:2]
    assert engine.block_manager.num_placed == [1, 0]  # type: ignore[union-attr]
    stats = engine.spec.stats  # type: ignore[union-attr]
    assert stats.num_accepted_tokens == stats.num_draft_tokens > 0


def test_rank_0_idle_under_unsorted_taps_and_sampled_drafts(
    target, prompts, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every request on rank 1: rank 0 has no rows in any target or draft forward, yet
    gathers every row's features (of target layers asked for out of order) and chooses
    sampled drafts for rows it does not hold. Seeded sampling, drafts sampled too: the
    output and every draft offered are one device's."""
    model_dir, _ = target
    draft = build_random_draft(model_dir, tmp_path / "draft", "eagle3", draft_vocab_size=48,
                               d2t=torch.arange(48))  # fmt: skip
    spec = SpeculativeConfig(
        str(draft), num_draft_tokens=3, target_layer_ids=(2, 0), sample_drafts=True
    )
    sampled = SamplingParams(max_tokens=10, temperature=0.9, seed=11, ignore_eos=True)
    one, _, offered_one = offered_drafts(model_dir, prompts[:2], spec, sampled, **CHUNKED)

    def rank_1(blocks: DataParallelBlocks, seq: Any) -> int | None:
        return 1 if blocks.ranks[1].can_allocate(seq) else None

    monkeypatch.setattr(DataParallelBlocks, "_place", rank_1)
    ours, engine, offered = offered_drafts(
        model_dir, prompts[:2], spec, sampled, data_parallel_size=2, **CHUNKED
    )
    assert engine.block_manager.num_placed == [0, 2]  # type: ignore[union-attr]
    assert ours == one
    assert offered == offered_one and len(offered) == 2

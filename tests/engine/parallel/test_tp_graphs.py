"""The graph runner's decode steps split over two ranks (``cuda_graphs=True`` on CPU: the
same padded steps and the same protocol as CUDA's, uncaptured; engine.executor.
graph_steps): rank 0 sends each graph's signature once, then names it, and its tensors
travel as one broadcast inside the step. Greedy output equals target-only output, seeded
rows draw what one device draws, an exact draft is accepted whole, and overlap scheduling
gives the same tokens. A draft splits as its target does, or runs on rank 0 alone; a
failure inside its forward stops the engine. On two GPUs, where the graphs are captured:
test_tp_cuda.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.executor.graph_steps import RankGraphs
from engine.executor.multiproc import RankLost
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.spec.config import SpeculativeConfig
from engine.spec.split_draft import SplitDrafter
from tests.engine.parallel.test_tp_engine import (
    GREEDY,
    engine_for,
    model,  # noqa: F401  (a fixture)
    prompts,  # noqa: F401  (a fixture)
    run,
    seeded,
)
from tests.engine.spec.test_spec_greedy import markov_target
from tests.engine.tiny_drafts import build_random_draft
from tests.services.cluster_helpers import engine_greedy


def graph_steps(engine: LLMEngine) -> tuple[int, RankGraphs]:
    """How many decode steps ran through the graph runner, and rank 0's messages."""
    assert engine.spec is not None and engine.spec.graphs is not None
    peers = engine.runner.executor.graph_peers
    assert isinstance(peers, RankGraphs)
    return engine.spec.graphs.num_graph_steps, peers


def test_graph_steps_at_tp_2_equal_target_only_and_one_device(
    model,  # noqa: F811
    prompts,  # noqa: F811
    tmp_path: Path,
) -> None:
    model_dir, _ = model
    draft = build_random_draft(model_dir, tmp_path / "eagle3", "eagle3", std=0.3)
    spec = SpeculativeConfig(str(draft), num_draft_tokens=3)
    requests = {str(i): p for i, p in enumerate(prompts)}
    target_only = engine_greedy(model_dir, prompts, 12)
    engine = engine_for(model_dir, 2, speculative=spec, cuda_graphs=True)
    try:
        got = run(engine, requests, GREEDY)
        sampled = {}
        for i, prompt in enumerate(prompts):
            sampled |= run(engine, {f"seeded-{i}": prompt}, seeded(i))
        steps, peers = graph_steps(engine)
    finally:
        engine.close()
    assert [got[str(i)] for i in range(len(prompts))] == target_only
    # Every decode step went through the graph runner, its three forwards (the target's,
    # the split draft's extend and propose) as named graphs: defined once per bucket and
    # shape, named every other time. The prefills' draft forwards ran once each.
    assert steps > 20
    assert peers.num_defined + peers.num_named == 3 * steps
    assert 0 < peers.num_defined <= 3 * 4
    assert peers.num_once > 0
    one = engine_for(model_dir, 1, speculative=spec, cuda_graphs=True)
    alone = {}
    try:
        for i, prompt in enumerate(prompts):
            alone |= run(one, {f"seeded-{i}": prompt}, seeded(i))
    finally:
        one.close()
    assert sampled == alone


def test_an_exact_draft_through_overlapped_graph_steps_at_tp_2(tmp_path: Path) -> None:
    """Each step launched before the previous one is read (overlap scheduling), its
    forward named to rank 1 ahead of the host: every draft accepted, target-only tokens."""
    target_dir, draft_dir, _ = markov_target(tmp_path)
    rows = [[5, 6, 7], [9] * 11, [40]]
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    base = engine_greedy(target_dir, rows, 30)
    spec = SpeculativeConfig(str(draft_dir), num_draft_tokens=4)
    engine = engine_for(
        target_dir, 2, speculative=spec, cuda_graphs=True, enable_overlap_scheduler=True
    )
    try:
        got = run(engine, {str(i): p for i, p in enumerate(rows)}, params)
        stats = engine.spec.stats  # type: ignore[union-attr]
        steps, peers = graph_steps(engine)
    finally:
        engine.close()
    assert [got[str(i)] for i in range(len(rows))] == base
    assert stats.num_accepted_tokens == stats.num_draft_tokens > 0
    assert steps >= 6 and peers.num_defined + peers.num_named == 3 * steps


def test_a_draft_splits_with_its_target_or_runs_on_rank_0_alone(
    model,  # noqa: F811
    prompts,  # noqa: F811
    tmp_path: Path,
) -> None:
    """Split, rank 0 holds half of the draft's KV heads and of its LM head's rows, and a
    transfer sees the draft's whole KV; ``draft_tensor_parallel_size=1`` keeps the whole
    draft on rank 0. Both give target-only output."""
    model_dir, _ = model
    draft = build_random_draft(model_dir, tmp_path / "eagle3", "eagle3", std=0.3)
    requests = {str(i): p for i, p in enumerate(prompts)}
    target_only = engine_greedy(model_dir, prompts, 12)
    whole_heads = json.loads((draft / "config.json").read_text())["num_key_value_heads"]
    for size, rows, heads in ((None, 34, whole_heads // 2), (1, 67, whole_heads)):
        spec = SpeculativeConfig(str(draft), num_draft_tokens=3, draft_tensor_parallel_size=size)
        engine = engine_for(model_dir, 2, speculative=spec)
        try:
            got = run(engine, requests, GREEDY)
            assert engine.spec is not None and engine.spec.draft_kv is not None
            drafter = engine.spec.drafter
            assert isinstance(drafter, SplitDrafter) == (size is None)
            assert drafter.lm_head.weight.shape[0] == rows  # type: ignore[union-attr]
            assert engine.spec.draft_kv.params.num_kv_heads == heads
            assert engine.kv_pools["draft"].params.num_kv_heads == whole_heads
        finally:
            engine.close()
        assert [got[str(i)] for i in range(len(prompts))] == target_only
    with pytest.raises(ValueError, match="draft_tensor_parallel_size: 3; a draft splits over"):
        engine_for(
            model_dir,
            2,
            speculative=SpeculativeConfig(str(draft), draft_tensor_parallel_size=3),
        )


def test_a_failure_inside_a_split_draft_stops_the_engine(
    model,  # noqa: F811
    prompts,  # noqa: F811
    tmp_path: Path,
) -> None:
    """Rank 1 may be anywhere in the draft's forward when rank 0's fails: no later
    collective can pair with its, so the engine refuses to step again (``RankLost``)."""
    model_dir, _ = model
    draft = build_random_draft(model_dir, tmp_path / "eagle3", "eagle3", std=0.3)
    engine = engine_for(model_dir, 2, speculative=SpeculativeConfig(str(draft)))
    try:
        assert isinstance(engine.spec.drafter, SplitDrafter)  # type: ignore[union-attr]

        def broken(*args: object, **kwargs: object) -> None:
            raise RuntimeError("injected")

        engine.spec.drafter.drafter.propose = broken  # type: ignore[union-attr]
        engine.add_request("0", prompts[0], GREEDY)
        with pytest.raises(RankLost, match=r"a forward failed on rank 0 .*injected"):
            while engine.has_unfinished_requests():
                engine.step()
        with pytest.raises(RankLost, match="an earlier forward failed"):
            engine.step()
    finally:
        engine.close()

"""The graph runner on a GPU: replay of captured graphs is bit-identical to the same padded
step run eagerly, for every bucket and drafter, and an engine whose batch changes size
every step stays identical to target-only greedy. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from engine.attention import get_backend
from engine.spec.graph_runner import StepGraphRunner
from tests.engine.spec.test_graph_runner import (
    BLOCK_SIZE,
    K,
    assert_graphs_equal_target_only,
    batch_inputs,
    kv_snapshot,
    make_runner,
    make_step,
    markov,  # noqa: F401 (a fixture)
    restore,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: graphs capture on a GPU"),
]
CUDA = torch.device("cuda")


@pytest.mark.parametrize("backend", ["torch", "auto"])
@pytest.mark.parametrize("kind", ["eagle", "eagle3", "dflash"])
def test_replay_is_bit_identical_to_eager_for_every_bucket(kind, backend):
    step = make_step(kind, CUDA, get_backend(backend, device=CUDA, block_size=BLOCK_SIZE))
    before = kv_snapshot(step)
    graphs = make_runner(step, use_graphs=True)
    assert len(graphs.graphs) == 2 * len(graphs.buckets)  # greedy and sampled, each bucket
    eager: StepGraphRunner = make_runner(step, use_graphs=False)
    for bucket in graphs.buckets:
        for b in sorted({bucket, max(1, bucket - 1)}):
            for is_greedy in (True, False):
                inputs = batch_inputs(b, K, greedy=is_greedy, device=CUDA)
                restore(step, before)
                want = eager(inputs, K)
                want_kv = kv_snapshot(step)
                restore(step, before)
                got = graphs(inputs, K)
                for name in ("num_accepted", "next_tokens", "emitted", "next_draft_tokens"):
                    assert torch.equal(getattr(got, name), getattr(want, name)), (b, name)
                assert torch.equal(got.logits, want.logits), (kind, b, is_greedy)
                for now, then in zip(kv_snapshot(step), want_kv, strict=True):
                    assert torch.equal(now, then), (kind, b, is_greedy)
    assert graphs.num_eager_steps == 0


def test_engine_batch_changing_size_every_step_equals_target_only(markov):  # noqa: F811
    target_dir, draft_dir, hf_model = markov
    assert assert_graphs_equal_target_only(target_dir, draft_dir, hf_model, device="cuda") >= 4

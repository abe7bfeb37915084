"""A decode worker moves its KV pools into memory same-host senders write in place
(``share_pools``). CUDA graphs address the pools: those that hold them are released
first, and captured again over the pools where they lie, which pins them again; graphs
that address other pools (a split worker's transfers read rank 0's copy) are left alone;
where the runtime refuses to share the pools, nothing moves. The CUDA capture itself is
recorded here (it needs a GPU); the rest is real."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from decode_worker.cli import share_pools
from engine.spec.graph_runner import GraphKey, StepGraphRunner
from kv_transfer import KvLayout, KvPool
from tests.engine.spec.test_graph_runner import make_runner, make_step


@pytest.fixture
def captured(monkeypatch: pytest.MonkeyPatch) -> list[GraphKey]:
    keys: list[GraphKey] = []

    def capture(runner: StepGraphRunner, key: GraphKey) -> None:
        keys.append(key)
        runner.graphs[key] = (None, None)  # type: ignore[assignment]

    monkeypatch.setattr(StepGraphRunner, "_capture", capture)
    return keys


def test_held_pools_move_between_a_release_and_a_recapture(captured) -> None:
    step = make_step("eagle")
    runner = make_runner(step, use_graphs=True)
    runner.hold(step.target_kv, step.draft_kv)
    assert len(captured) == 8 and not step.target_kv.is_placeable
    k = step.target_kv.layers[1][0]
    before = k.clone()
    pools = {"target": step.target_kv, "draft": step.draft_kv}
    engine = SimpleNamespace(spec=SimpleNamespace(graphs=runner), kv_pools=pools)
    layout = KvLayout.of_pools("tiny", step.target_kv, step.draft_kv, "eagle-abc")
    shared = share_pools(engine, layout)
    try:
        assert shared is not None
        assert k.data_ptr() == shared.layer(KvPool.TARGET, 1)[0].data_ptr()  # moved in
        assert torch.equal(k, before)
        assert len(captured) == 16 and len(runner.graphs) == 8  # every graph again
        assert not step.target_kv.is_placeable and not step.draft_kv.is_placeable
    finally:
        if shared is not None:
            shared.close()


def test_graphs_over_other_pools_stay(captured) -> None:
    step = make_step("eagle")
    runner = make_runner(step, use_graphs=True)
    runner.hold(step.target_kv, step.draft_kv)
    other = make_step("eagle")  # rank 0's copy, say: no graph addresses it
    pools = {"target": other.target_kv, "draft": other.draft_kv}
    engine = SimpleNamespace(spec=SimpleNamespace(graphs=runner), kv_pools=pools)
    layout = KvLayout.of_pools("tiny", other.target_kv, other.draft_kv, "eagle-abc")
    shared = share_pools(engine, layout)
    assert shared is not None
    shared.close()
    assert len(captured) == 8  # not released, not captured again
    assert not step.target_kv.is_placeable


def test_pools_a_runtime_refuses_to_share_stay_with_their_graphs(
    captured, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where CUDA IPC is refused (``SharedKvPools.refusal``, asked before anything moves),
    the graphs are neither released nor captured again, and the pools stay pinned."""
    from kv_transfer import SharedKvPools

    step = make_step("eagle")
    runner = make_runner(step, use_graphs=True)
    runner.hold(step.target_kv, step.draft_kv)
    asked: list[torch.device] = []

    def refuse(device: torch.device) -> str:
        asked.append(device)
        return "cuIpcGetMemHandle: CUDA error 801 (operation not supported)"

    monkeypatch.setattr(SharedKvPools, "refusal", staticmethod(refuse))
    pools = {"target": step.target_kv, "draft": step.draft_kv}
    engine = SimpleNamespace(spec=SimpleNamespace(graphs=runner), kv_pools=pools)
    layout = KvLayout.of_pools("tiny", step.target_kv, step.draft_kv, "eagle-abc")
    assert share_pools(engine, layout) is None
    assert asked == [step.target_kv.layers[0][0].device]
    assert len(captured) == 8 and len(runner.graphs) == 8  # captured once, kept
    assert not step.target_kv.is_placeable and not step.draft_kv.is_placeable

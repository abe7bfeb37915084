"""AdaptiveK: the K with the most expected tokens per second, from costs that follow the
steps actually run and acceptance that follows the drafts actually accepted."""

from __future__ import annotations

import pytest

from engine.spec.adaptive import AdaptiveK


def startup_costs() -> dict[int, dict[int, float]]:
    """What a start-up measurement on short contexts shows: deeper drafts almost free."""
    return {8: {0: 1.0, 1: 1.05, 2: 1.1}, 32: {0: 4.0, 1: 4.2, 2: 4.4}}


def test_expected_tokens_follow_the_acceptance_per_position() -> None:
    adaptive = AdaptiveK([0, 1, 2], startup_costs(), prior_acceptance=0.5)
    assert adaptive.expected_tokens(0) == 1.0
    assert adaptive.expected_tokens(2) == pytest.approx(1 + 0.5 + 0.25)
    for _ in range(200):  # the first draft accepted in 4 rows of 5, the second never
        adaptive.observe(2, [1, 1, 1, 1, 0])
    assert adaptive.alphas() == pytest.approx([0.8, 0.0], abs=0.01)
    assert adaptive.expected_tokens(2) == pytest.approx(1.8, abs=0.01)


def test_observed_step_costs_turn_speculation_off_where_it_does_not_pay() -> None:
    """Batch 32 at long contexts: K=1 really costs 1.9 plain steps for 1.5 tokens, so K
    goes to 0 there once observed; batch 8, where it costs 1.1, keeps speculating."""
    adaptive = AdaptiveK([0, 1], {8: {0: 1.0, 1: 1.05}, 32: {0: 4.0, 1: 4.2}}, probe_budget=0)
    assert adaptive.choose(32) == 1 and adaptive.choose(8) == 1  # the start-up view
    for _ in range(30):
        adaptive.observe(1, [1, 0] * 16)  # half the drafts accepted: 1.5 tokens per step
        adaptive.observe_cost(32, 1, 7.6)
        adaptive.observe_cost(8, 1, 1.1)
    assert adaptive.costs[32][1] == pytest.approx(7.6, rel=0.01)
    assert adaptive.choose(32) == 0 and adaptive.choose(8) == 1
    for _ in range(30):  # plain steps cost what they cost: still K=0 at batch 32
        adaptive.observe_cost(32, 0, 4.1)
    assert adaptive.choose(32) == 0


def test_a_stalled_step_moves_its_cost_estimate_by_a_bounded_amount() -> None:
    """A step that compiled a graph took seconds; the estimate rises 20% (twice the
    estimate, at weight 0.2), not to a second, and that K stays the best choice."""
    adaptive = AdaptiveK([0, 1], {1: {0: 0.010, 1: 0.011}}, probe_budget=0)
    for _ in range(50):
        adaptive.observe(1, [1])
    assert adaptive.choose(1) == 1
    adaptive.observe_cost(1, 1, 30.0)
    assert adaptive.costs[1][1] == pytest.approx(0.011 * 1.2)
    assert adaptive.choose(1) == 1
    for _ in range(20):  # a real rise is followed: towards 0.03 within 20 steps
        adaptive.observe_cost(1, 1, 0.03)
    assert adaptive.costs[1][1] == pytest.approx(0.03, rel=0.01)


def test_a_step_cost_is_scaled_to_its_bucket_and_unknown_depths_are_ignored() -> None:
    adaptive = AdaptiveK([0, 1, 2], startup_costs(), cost_weight=1.0)
    adaptive.observe_cost(20, 0, 3.0)  # 20 rows fall in bucket 32: 3.0 x 32 / 20
    assert adaptive.costs[32][0] == pytest.approx(4.8)
    adaptive.observe_cost(40, 0, 5.0)  # past the largest bucket: counted in it
    assert adaptive.costs[32][0] == pytest.approx(4.0)
    adaptive.observe_cost(8, 5, 9.0)  # a depth the controller never chooses
    adaptive.observe_cost(0, 0, 9.0)  # no rows
    assert adaptive.costs[8] == startup_costs()[8]


def test_probes_refresh_the_deepest_acceptance_within_their_budget() -> None:
    """A probe spends what a K=2 step costs beyond a plain one; every plain step earns an
    eighth of its cost. Batch 8: 0.5 extra per probe, 0.125 earned per step: every 4th
    step. Batch 32: 2.0 extra, 0.5 per step: every 4th step too. Time charged from outside
    (the drafter catching up) delays the next probe by as many steps as it cost."""
    costs = {8: {0: 1.0, 1: 1.25, 2: 1.5}, 32: {0: 4.0, 1: 5.0, 2: 6.0}}
    adaptive = AdaptiveK([0, 1, 2], costs, probe_budget=0.125)
    for _ in range(50):
        adaptive.observe(2, [0] * 8)  # nothing accepted: K=0 is best
    assert [adaptive.choose(8) for _ in range(8)] == [0, 0, 0, 2] * 2
    assert [adaptive.choose(32) for _ in range(4)] == [0, 0, 0, 2]
    adaptive.charge(1.0)  # two plain steps' worth of credit at batch 32
    assert [adaptive.choose(32) for _ in range(6)] == [0] * 5 + [2]
    unprobed = AdaptiveK([0, 1, 2], costs, probe_budget=0)
    for _ in range(50):
        unprobed.observe(2, [0] * 8)
    assert {unprobed.choose(8) for _ in range(100)} == {0}

"""AdaptiveK: the K with the most expected tokens per second, from costs that grow with the
context and follow the steps actually run, and acceptance that follows the drafts actually
accepted."""

from __future__ import annotations

import pytest

from engine.spec.adaptive import AdaptiveK, CostRefresh, StepCost


def flat(costs: dict[int, dict[int, float]]) -> dict[int, dict[int, StepCost]]:
    """Costs that do not grow with the context."""
    return {b: {k: StepCost(seconds) for k, seconds in by_k.items()} for b, by_k in costs.items()}


def startup_costs() -> dict[int, dict[int, StepCost]]:
    """What a start-up measurement on short contexts shows: deeper drafts almost free."""
    return flat({8: {0: 1.0, 1: 1.05, 2: 1.1}, 32: {0: 4.0, 1: 4.2, 2: 4.4}})


def test_expected_tokens_follow_the_acceptance_per_position() -> None:
    adaptive = AdaptiveK([0, 1, 2], startup_costs(), prior_acceptance=0.5)
    assert adaptive.expected_tokens(0) == 1.0
    assert adaptive.expected_tokens(2) == pytest.approx(1 + 0.5 + 0.25)
    for _ in range(200):  # the first draft accepted in 4 rows of 5, the second never
        adaptive.observe(2, [1, 1, 1, 1, 0])
    assert adaptive.alphas() == pytest.approx([0.8, 0.0], abs=0.01)
    assert adaptive.expected_tokens(2) == pytest.approx(1.8, abs=0.01)


def test_observed_steps_scale_their_bucket_alike_and_the_start_up_lines_choose() -> None:
    """Batch 32: K=1 costs 2 plain steps for 1.5 tokens; batch 8: 1.05 plain steps. A slow
    spell of the machine (plain steps at 1.5x) prices every K of that bucket higher, and
    changes no choice: with a price per K, the plain steps' would have made K=1 look
    cheaper."""
    costs = flat({8: {0: 1.0, 1: 1.05}, 32: {0: 4.0, 1: 8.0}})
    adaptive = AdaptiveK([0, 1], costs, prior_acceptance=0.5, probe_budget=0)
    assert adaptive.choose(32) == 0 and adaptive.choose(8) == 1
    for _ in range(30):
        adaptive.observe(1, [1, 0] * 16)  # half the drafts accepted: 1.5 tokens per step
        adaptive.observe_cost(32, 0, 6.0)
    assert adaptive.cost(32, 0) == pytest.approx(6.0, rel=0.01)
    assert adaptive.cost(32, 1) == pytest.approx(12.0, rel=0.01)
    assert adaptive.cost(8, 1) == 1.05
    assert adaptive.choose(32) == 0 and adaptive.choose(8) == 1


def test_a_step_cost_is_a_line_in_the_context_fitted_through_two_measurements() -> None:
    line = StepCost.fit((32, 0.050), (512, 0.098))
    assert line.per_token == pytest.approx(0.0001)
    assert line.at(32) == pytest.approx(0.050) and line.at(2048) == pytest.approx(0.2516)
    assert StepCost.fit((32, 0.050), (512, 0.049)).at(1024) == 0.050  # noise: never falling
    # A slow spell during the long measurement: the line would cross zero at 16 tokens, but
    # below the short context the cost stays what was measured there.
    stalled = StepCost.fit((32, 0.005), (256, 0.075))
    assert stalled.at(0) == stalled.at(16) == stalled.at(32) == pytest.approx(0.005)
    assert stalled.at(256) == pytest.approx(0.075)


def test_costs_below_the_measured_contexts_keep_the_engine_time_positive() -> None:
    line = StepCost.fit((32, 0.005), (256, 0.075))
    adaptive = AdaptiveK([0, 1], {1: {0: line, 1: line}})
    adaptive.observe_overhead(1, 0.004, context=8.0)
    assert adaptive.overhead == pytest.approx(0.2 * 0.004)
    adaptive.observe_cost(1, 0, 0.005, context=8.0)  # as estimated: the scale stays
    assert adaptive.scales[1] == pytest.approx(1.0)


def test_long_contexts_turn_speculation_off_that_short_ones_make_pay() -> None:
    """Batch 32, half the drafts accepted: at 32 tokens K=1 costs 1.1 plain steps for 1.5
    tokens; at 1000 tokens, where attention over two queries a row weighs, 2.4."""
    costs = {32: {0: StepCost(4.0, 0.004), 1: StepCost(4.2, 0.016)}}
    adaptive = AdaptiveK([0, 1], costs, prior_acceptance=0.5, probe_budget=0)
    assert adaptive.choose(32, context=32) == 1
    assert adaptive.choose(32, context=1000) == 0
    # A step seen at 1.5x its line lifts both lines, at every context.
    adaptive.cost_weight = 1.0
    adaptive.observe_cost(32, 0, 1.5 * costs[32][0].at(1000), context=1000)
    assert adaptive.cost(32, 0, 32) == pytest.approx(1.5 * costs[32][0].at(32))
    assert adaptive.cost(32, 1, 32) == pytest.approx(1.5 * costs[32][1].at(32))


def test_a_stalled_step_moves_its_cost_estimate_by_a_bounded_amount() -> None:
    """A step that compiled a graph took seconds; the estimates rise 20% (twice the
    estimate, at weight 0.2), not to a second."""
    adaptive = AdaptiveK([0, 1], flat({1: {0: 0.010, 1: 0.011}}), probe_budget=0)
    for _ in range(50):
        adaptive.observe(1, [1])
    assert adaptive.choose(1) == 1
    adaptive.observe_cost(1, 1, 30.0)
    assert adaptive.cost(1, 1) == pytest.approx(0.011 * 1.2)
    assert adaptive.choose(1) == 1
    for _ in range(20):  # a real rise is followed: towards 0.03 within 20 steps
        adaptive.observe_cost(1, 1, 0.03)
    assert adaptive.cost(1, 1) == pytest.approx(0.03, rel=0.01)


def test_a_step_cost_is_scaled_to_its_bucket_and_unknown_depths_are_ignored() -> None:
    adaptive = AdaptiveK([0, 1, 2], startup_costs(), cost_weight=1.0)
    adaptive.observe_cost(20, 0, 3.0)  # 20 rows fall in bucket 32: 3.0 x 32 / 20
    assert adaptive.cost(32, 0) == pytest.approx(4.8)
    adaptive.observe_cost(40, 0, 5.0)  # past the largest bucket: counted in it
    assert adaptive.cost(32, 0) == pytest.approx(4.0)
    adaptive.observe_cost(8, 5, 9.0)  # a depth the controller never chooses
    adaptive.observe_cost(0, 0, 9.0)  # no rows
    assert [adaptive.cost(8, k) for k in (0, 1, 2)] == [1.0, 1.05, 1.1]


def test_probes_refresh_the_deepest_acceptance_within_their_budget() -> None:
    """A probe spends what a K=2 step costs beyond a plain one; every plain step earns an
    eighth of its cost. Batch 8: 0.5 extra per probe, 0.125 earned per step: every 4th
    step. Batch 32: 2.0 extra, 0.5 per step: every 4th step too. Time charged from outside
    (the drafter catching up) delays the next probe by as many steps as it cost."""
    costs = flat({8: {0: 1.0, 1: 1.25, 2: 1.5}, 32: {0: 4.0, 1: 5.0, 2: 6.0}})
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


def test_the_engine_time_every_step_pays_makes_deep_drafts_pay_sooner() -> None:
    """Batch 1: K=3 steps cost 1.7 plain steps and yield 1.6 tokens. Alone, a loss; with
    the engine's own time per step (half a plain step, every K alike) 1.6 / 2.2 beats
    1 / 1.5. A pause of the process counts at most a plain step."""
    costs = flat({1: {0: 1.0, 3: 1.7}})
    adaptive = AdaptiveK([0, 3], costs, prior_acceptance=0.5, probe_budget=0)
    for _ in range(200):  # 3 drafts, the first accepted in 3 rows of 5, then never
        adaptive.observe(3, [1, 1, 1, 0, 0])
    assert adaptive.expected_tokens(3) == pytest.approx(1.6, abs=0.01)
    assert adaptive.choose(1) == 0
    adaptive.cost_weight = 1.0
    adaptive.observe_overhead(1, 0.5)
    assert adaptive.overhead == pytest.approx(0.5)
    assert adaptive.choose(1) == 3
    adaptive.observe_overhead(1, 30.0)
    assert adaptive.overhead == pytest.approx(1.0)


def test_rows_of_different_depths_count_where_each_verified() -> None:
    costs = flat({4: {0: 1.0, 1: 1.1, 2: 1.2, 3: 3.0}})
    adaptive = AdaptiveK([0, 1, 2, 3], costs, prior_acceptance=0.9, probe_budget=0)
    adaptive.observe_rows([2, 1, 0, 0], [2, 0, 0, 0])
    # position 0: two rows verified it, one passed; position 1: one verified, one passed
    assert adaptive._verified[:2] == pytest.approx([0.98 + 2, 0.98 + 1])
    assert adaptive._accepted[:2] == pytest.approx([0.98 * 0.9 + 1, 0.98 * 0.9 + 1])


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_bucket_whose_steps_run_longer_is_timed_again_one_k_at_a_time_within_budget():
    """Costs measured up to 512 tokens; steps at 2,000 make the bucket stale. While idle,
    each call times one K (3 steps, at 1.5x the context seen), and the bucket's lines
    change together once every K is timed; the budget (share of the time since start,
    plus an allowance) stops it, and a bucket whose steps would pause too long is left to
    its observed scale."""
    costs = {8: {k: StepCost.fit((32, 0.01 * (k + 1)), (512, 0.02 * (k + 1))) for k in (0, 1)}}
    adaptive = AdaptiveK([0, 1], costs, measured_context=512, probe_budget=0)
    adaptive.choose(8, 600.0)
    assert adaptive.stale == {}  # within 1.5x of what was measured
    adaptive.choose(8, 2000.0)
    assert adaptive.stale == {8: 2000.0}
    clock, timed = FakeClock(), []

    def run_step(b: int, k: int, context: int) -> float:
        timed.append((b, k, context))
        clock.now += 0.05
        return 0.1 * (k + 1)  # the truth: far dearer than the line's 0.06 (k=0) at 3,000

    refresh = CostRefresh(adaptive, 4000, share=0.02, allowance_s=0.2, max_pause_s=1.0, clock=clock)
    assert refresh.is_wanted()
    before = adaptive.costs[8][1]
    assert refresh.run_one(run_step) == pytest.approx(0.15)  # K = 0: three steps
    assert timed == [(8, 0, 3000)] * 3
    assert adaptive.costs[8][1] == before and 8 in adaptive.stale  # not yet: K = 1 next
    refresh.run_one(run_step)
    assert adaptive.stale == {} and adaptive.measured[8] == 3000 and refresh.num_refreshed == 1
    for k in (0, 1):
        assert adaptive.costs[8][k].at(3000) == pytest.approx(0.1 * (k + 1))
        assert adaptive.costs[8][k].at(32) == pytest.approx(0.01 * (k + 1))  # short end kept
    # Stale again at 10,000: the budget (0.2 s + 2% of 0.3 s) is spent.
    adaptive.choose(8, 10000.0)
    assert not refresh.is_wanted()
    clock.now += 100.0  # two seconds of budget more
    assert refresh.is_wanted()
    # At 4,000 (the longest scratch context) three K=1 steps would take 0.6 s or more.
    refresh.max_pause_s = 0.5
    assert refresh.run_one(run_step) == 0.0 and adaptive.stale == {} and len(timed) == 6


def test_a_packed_step_costs_a_uniform_step_of_as_many_tokens() -> None:
    """A packed step of 8 rows and 8 drafts costs what a uniform step at depth 1 does;
    between two measured depths, the line between them."""
    costs = flat({8: {0: 1.0, 1: 1.5, 2: 2.0, 3: 2.5, 4: 3.0}})
    adaptive = AdaptiveK([0, 1, 2, 3, 4], costs, probe_budget=0)
    assert adaptive.cost_at(8, 1.0) == 1.5 and adaptive.cost_at(8, 2.5) == pytest.approx(2.25)

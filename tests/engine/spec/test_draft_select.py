"""Suffix decoding's per-row selection (engine.spec.draft_select): acceptance learned per
bin from exact counts, and which tokens a step verifies under injected step costs (no
timing decides): the ones that pay, all of them, none, and a probe from its budget."""

from __future__ import annotations

import pytest

from engine.spec.adaptive import AdaptiveK, StepCost
from engine.spec.draft_select import AcceptanceBins, Bin, DraftSelector
from engine.spec.suffix import Proposal


def costs(per_k: float, probe_budget: float = 0.0) -> AdaptiveK:
    """Steps of 8 rows: 32 ms plain, ``per_k`` seconds more per draft a row."""
    line = {k: StepCost(0.032 + per_k * k) for k in range(4)}
    return AdaptiveK(range(4), {8: line}, probe_budget=probe_budget)


LONG = Proposal([1, 2, 3], [1.0, 1.0, 1.0], 20)  # 16+ tokens matched: prior 16/17 a token
SHORT = Proposal([4, 5], [1.0, 1.0], 2)  # the key alone: prior 2/3
SPLIT = Proposal([6], [0.5], 3)  # 3 tokens matched, occurrences disagreeing: 3/4 * 1/2
ROWS = [LONG, SHORT, SPLIT] + [Proposal.empty()] * 5


def test_bins_start_from_the_match_length_and_learn_from_reached_tokens():
    bins = AcceptanceBins()
    assert bins.bin(2, 0, 1.0) == (2, 0, True)
    assert bins.bin(5, 1, 1.0) == (3, 1, True)
    assert bins.bin(40, 9, 0.5) == (16, 4, False)
    assert bins.values(SHORT) == pytest.approx([2 / 3, 4 / 9])
    # 3 verified, the first accepted: positions 0 and 1 reached, 2 not
    bins.observe(Proposal([4, 5, 7], [1.0, 1.0, 1.0], 2), verified=3, accepted=1)
    first, second = (1 + 2 * 2 / 3) / 3, (0 + 2 * 2 / 3) / 3
    assert bins.rate(Bin(2, 0, True)) == pytest.approx(first)
    assert bins.rate(Bin(2, 1, True)) == pytest.approx(second)
    assert bins.rate(Bin(2, 2, True)) == pytest.approx(2 / 3)  # not reached: the prior
    # a second observation decays the first by 0.99
    bins.observe(SHORT, verified=1, accepted=0)
    assert bins.rate(Bin(2, 0, True)) == pytest.approx((0.99 + 4 / 3) / (1.99 + 2))


def test_a_step_verifies_the_tokens_that_pay_for_what_they_cost():
    """2 ms a draft token against 4 ms a row's plain token: the long match's three tokens
    (0.94, 0.89, 0.84 to be emitted) and the short match's first (0.67) pay; its second
    (0.44) and the split match's (0.375) would lower the tokens per second."""
    selector = DraftSelector()
    assert selector.select(costs(0.016), 8, 100.0, ROWS) == [3, 1, 0, 0, 0, 0, 0, 0]


def test_cheap_drafts_verify_every_proposed_token_and_dear_ones_none():
    selector = DraftSelector()
    assert selector.select(costs(0.0001), 8, 100.0, ROWS) == [3, 2, 1, 0, 0, 0, 0, 0]
    assert selector.select(costs(0.5), 8, 100.0, ROWS) == [0] * 8
    # no deeper than the cost table's largest K
    shallow = AdaptiveK(range(3), {8: {k: StepCost(0.032 + 0.0001 * k) for k in range(3)}})
    assert selector.select(shallow, 8, 100.0, ROWS) == [2, 2, 1, 0, 0, 0, 0, 0]


def test_a_probe_verifies_everything_once_the_budget_covers_it():
    """Each step earns half its cost (32 ms) of credit; verifying all 6 tokens costs 375 ms
    more than verifying none: the 24th step probes, and only it."""
    selector, table = DraftSelector(), costs(0.5, probe_budget=0.5)
    chosen = [selector.select(table, 8, 100.0, ROWS) for _ in range(30)]
    probes = [i for i, lengths in enumerate(chosen) if any(lengths)]
    assert probes == [23] and chosen[23] == [3, 2, 1, 0, 0, 0, 0, 0]
    assert selector.num_probes == 1


def test_what_rows_accept_moves_the_selection():
    """Short matches that are always accepted come to pay in full; the selector learns it
    from its own steps' outcomes."""
    selector, table = DraftSelector(), costs(0.016)
    assert selector.select(table, 8, 100.0, ROWS)[1] == 1
    for _ in range(20):
        selector.observe([SHORT], [2], [2])
    assert selector.select(table, 8, 100.0, ROWS)[1] == 2


def test_a_step_at_a_longer_context_than_measured_marks_its_bucket_stale():
    table = costs(0.016)
    table.measured[8] = 100.0
    DraftSelector().select(table, 8, 400.0, ROWS)
    assert table.stale == {8: 400.0}

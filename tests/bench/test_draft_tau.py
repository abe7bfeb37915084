"""The reference tau of ``bench/draft_tau.py --reference``: decoding's steps, in expectation."""

import pytest

from bench.draft_tau import reference_tau


def test_a_sure_draft_takes_k_plus_one_tokens_a_step_and_a_wrong_one_one():
    # 10 tokens: the first from prefill; K=5 steps emit 6, then the last 3 (cut at the end).
    assert reference_tau([[1.0] * 10], 5) == pytest.approx(9 / 2)
    assert reference_tau([[0.0] * 10], 5) == pytest.approx(1.0)


def test_steps_are_counted_in_expectation_from_where_each_one_starts():
    # K=1, tokens 1 and 2 each agreed with at 0.5: from token 1, half the steps emit 2
    # tokens and end; the other half emit 1 and leave token 2 for one more step.
    assert reference_tau([[0.9, 0.5, 0.5]], 1) == pytest.approx(2 / 1.5)
    # Rows pool their tokens and steps, not their taus: a sure row of 10 tokens takes 5
    # steps of 2 at K=1, so (2 + 9) tokens in (1.5 + 5) steps.
    assert reference_tau([[0.9, 0.5, 0.5], [1.0] * 10], 1) == pytest.approx((2 + 9) / (1.5 + 5))


def test_a_long_run_at_constant_agreement_approaches_the_geometric_sum():
    q, k = 0.6, 5
    expected = sum(q**j for j in range(k + 1))
    assert reference_tau([[q] * 5000], k) == pytest.approx(expected, rel=1e-2)

"""Sampler: greedy rows, filters on hand-made logits, seeded draws as a pure function of
(seed, position), the drawn distribution (chi-square), top_logprobs, the hash helpers, and
logit bias and penalties against a plain reference and transformers' processor."""

from __future__ import annotations

import math

import pytest
import torch

from engine.sampler import (
    SamplingTensors,
    draw,
    filtered_probs,
    hash32,
    penalized,
    row_keys,
    sample,
    threshold,
    top_logprobs,
    uniform,
)
from engine.sampling_params import SamplingParams
from tests.engine.penalty_reference import reference_penalized

M32 = 0xFFFFFFFF
CPU = torch.device("cpu")


def tensors(
    params: list[SamplingParams], seeds: list[int] | None = None, positions: list[int] | None = None
) -> SamplingTensors:
    n = len(params)
    return SamplingTensors.build(params, seeds or [0] * n, positions or [0] * n, CPU)


def keep_mask(logits: list[float], **kw: float) -> list[bool]:
    probs = filtered_probs(torch.tensor([logits]), tensors([SamplingParams(**kw)]))
    return (probs[0] > 0).tolist()


# -- greedy ---------------------------------------------------------------------------


def test_greedy_rows_are_argmax_in_a_mixed_batch() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=gen)
    params = [SamplingParams(temperature=0.0, top_k=3), SamplingParams(temperature=1.0)] * 3
    out = sample(logits, tensors(params, seeds=[1, 2, 3, 4, 5, 6], positions=[7] * 6))
    argmax = logits.argmax(dim=-1)
    assert out[0::2].tolist() == argmax[0::2].tolist()
    all_greedy = tensors([SamplingParams(temperature=0.0)] * 6)
    assert all_greedy.all_greedy
    assert sample(logits, all_greedy).tolist() == argmax.tolist()


# -- filters --------------------------------------------------------------------------

LOGITS = [3.0, 1.0, 2.0, 0.0, -1.0, 2.5, 0.5, -2.0]  # order: 0, 5, 2, 1, 6, 3, 4, 7


def test_top_k_keeps_exactly_k() -> None:
    for k in range(1, 9):
        mask = keep_mask(LOGITS, top_k=k)
        assert sum(mask) == k
        kept = {i for i, m in enumerate(mask) if m}
        assert kept == set(sorted(range(8), key=lambda i: -LOGITS[i])[:k])
    assert sum(keep_mask(LOGITS, top_k=100)) == 8


def test_top_p_keeps_smallest_prefix_reaching_the_mass() -> None:
    logits = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.1])).tolist()
    assert keep_mask(logits, top_p=0.35) == [True, False, False, False]
    assert keep_mask(logits, top_p=0.4) == [True, False, False, False]
    assert keep_mask(logits, top_p=0.45) == [True, True, False, False]
    assert keep_mask(logits, top_p=0.75) == [True, True, True, False]
    assert keep_mask(logits, top_p=0.95) == [True, True, True, True]
    assert keep_mask(logits, top_p=0.01) == [True, False, False, False]  # never empty
    assert keep_mask(logits, top_p=1e-30) == [True, False, False, False]  # mass rounds to 0
    probs = filtered_probs(torch.tensor([logits]), tensors([SamplingParams(top_p=0.75)]))
    torch.testing.assert_close(probs[0], torch.tensor([4 / 9, 3 / 9, 2 / 9, 0.0]))


def test_min_p_threshold_is_relative_to_the_top_token() -> None:
    logits = torch.log(torch.tensor([0.5, 0.25, 0.15, 0.1])).tolist()
    assert keep_mask(logits, min_p=0.5) == [True, True, False, False]  # 0.25 >= 0.25
    assert keep_mask(logits, min_p=0.3) == [True, True, True, False]
    assert keep_mask(logits, min_p=0.19) == [True, True, True, True]
    assert keep_mask(logits, min_p=1.0) == [True, False, False, False]


def test_combined_filters_and_temperature() -> None:
    logits = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.1])).tolist()
    # top-k 3 renormalises to 4/9, 3/9, 2/9; top-p 0.7 then keeps the first two.
    assert keep_mask(logits, top_k=3, top_p=0.7) == [True, True, False, False]
    assert keep_mask(logits, top_k=3, top_p=0.8) == [True, True, True, False]
    # min-p 0.6: 0.3/0.4 = 0.75 kept, 0.2/0.4 = 0.5 dropped.
    assert keep_mask(logits, top_k=4, top_p=1.0, min_p=0.6) == [True, True, False, False]
    # Temperature 0.5 squares the probabilities before the filters: 16:9:4:1 over 30.
    t = tensors([SamplingParams(temperature=0.5, top_p=0.9)])
    probs = filtered_probs(torch.tensor([logits]), t)[0]
    torch.testing.assert_close(probs, torch.tensor([16 / 29, 9 / 29, 4 / 29, 0.0]))
    t = tensors([SamplingParams(temperature=2.0)])
    probs = filtered_probs(torch.tensor([logits]), t)[0]
    torch.testing.assert_close(probs, torch.softmax(torch.tensor(logits) / 2.0, dim=-1))


def test_filters_are_per_row() -> None:
    logits = torch.tensor([LOGITS] * 3)
    params = [SamplingParams(top_k=2), SamplingParams(), SamplingParams(min_p=0.3)]
    probs = filtered_probs(logits, tensors(params))
    assert (probs > 0).sum(dim=-1).tolist() == [2, 8, 3]  # e^-0.5, e^-1 >= 0.3 > e^-2
    torch.testing.assert_close(probs[1], torch.softmax(logits[1], dim=-1))


def test_top_k_keeps_tokens_tied_with_the_last_one() -> None:
    # A threshold, not a rank: which of two equal tokens a sort puts first is arbitrary.
    logits = [2.0, 1.0, 1.0, 0.0, 1.0]
    assert keep_mask(logits, top_k=2) == [True, True, True, False, True]
    assert keep_mask(logits, top_k=1) == [True, False, False, False, False]
    assert keep_mask(logits, top_k=5) == [True] * 5


def brute_threshold(values: list[float], weights: list[int], target: int) -> float:
    """The largest value whose tokens at or above it weigh at least ``target``."""
    return max(
        v
        for v in values
        if sum(w for u, w in zip(values, weights, strict=True) if u >= v) >= target
    )


def test_threshold_is_the_exact_weighted_order_statistic() -> None:
    gen = torch.Generator().manual_seed(3)
    rows, vocab = 64, 300
    # Values across the whole non-negative fp32 range, many of them tied: zeros,
    # subnormals, tiny and large exponents, and equal values within a row.
    scale = torch.tensor([0.0, 1e-42, 1e-30, 1e-8, 1e-3, 1.0, 1e30])
    mantissa = torch.randint(1, 5, (rows, vocab), generator=gen).float()
    values = mantissa * scale[torch.randint(0, len(scale), (rows, vocab), generator=gen)]
    weights = torch.randint(0, 1000, (rows, vocab), generator=gen)
    weights[::4] = 1  # counts: top-k
    totals = weights.sum(-1)
    target = (torch.rand(rows, generator=gen, dtype=torch.float64) * totals).long() + 1
    target[1], target[2] = 1, totals[2]  # the largest value; the least value of all
    got = threshold(values.view(torch.int32), weights, target).view(torch.float32)
    for r in range(rows):
        expected = brute_threshold(values[r].tolist(), weights[r].tolist(), int(target[r]))
        assert got[r].item() == expected, r


# -- seeded draws -----------------------------------------------------------------------


def test_seeded_draw_is_a_pure_function_of_seed_and_position() -> None:
    gen = torch.Generator().manual_seed(1)
    vocab = 300
    row = torch.randn(vocab, generator=gen) * 0.3  # flat-ish: many plausible tokens
    p = SamplingParams(temperature=0.9, top_k=200, top_p=0.95)
    for pos in range(12):
        alone = sample(row[None], tensors([p], seeds=[1234], positions=[pos])).item()
        for index, size in ((0, 4), (3, 4), (6, 7)):
            others = torch.randn(size, vocab, generator=gen)
            logits = others.clone()
            logits[index] = row
            params = [
                SamplingParams(temperature=1.3),
                SamplingParams(temperature=0.0),
                SamplingParams(min_p=0.2),
                SamplingParams(top_k=5),
            ] * 2
            params = params[:size]
            params[index] = p
            seeds = [int(s) for s in torch.randint(0, 2**62, (size,), generator=gen)]
            seeds[index] = 1234
            positions = [int(s) for s in torch.randint(0, 10_000, (size,), generator=gen)]
            positions[index] = pos
            batched = sample(logits, tensors(params, seeds, positions))
            assert batched[index].item() == alone, (pos, index, size)


def test_different_positions_and_seeds_draw_differently() -> None:
    vocab = 1000
    logits = torch.zeros(200, vocab)  # uniform: a draw is a uniform pick
    params = [SamplingParams(temperature=1.0)] * 200
    by_position = sample(logits, tensors(params, seeds=[7] * 200, positions=list(range(200))))
    by_seed = sample(logits, tensors(params, seeds=list(range(200)), positions=[7] * 200))
    # 200 uniform picks from 1000 have ~18 collisions; a broken key would give 1 value.
    assert len(set(by_position.tolist())) > 160
    assert len(set(by_seed.tolist())) > 160
    assert by_position.tolist() != by_seed.tolist()
    # Seeds differing only in their high 32 bits differ too.
    high = sample(logits[:50], tensors(params[:50], [s << 32 for s in range(50)], [3] * 50))
    assert len(set(high.tolist())) > 40


# Critical values of the chi-square distribution at p = 0.001, by degrees of freedom.
CHI2_CRIT_001 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458, 7: 24.322}


def expected_probs(logits: list[float], temperature: float, top_k: int, top_p: float, min_p: float):
    """Independent reference for the filtered distribution, in float64 Python."""
    z = [x / temperature for x in logits]
    order = sorted(range(len(z)), key=lambda i: -z[i])
    kept = order[: top_k or len(z)]
    m = max(z)
    w = {i: math.exp(z[i] - m) for i in kept}
    total = sum(w.values())
    p = {i: w[i] / total for i in kept}
    out, mass = [], 0.0
    for i in kept:
        if mass < top_p and p[i] >= min_p * p[kept[0]]:
            out.append(i)
        mass += p[i]
    s = sum(w[i] for i in out)
    return [w[i] / s if i in out else 0.0 for i in range(len(z))]


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p", "min_p"),
    [(1.0, 0, 1.0, 0.0), (0.7, 6, 0.9, 0.05), (1.5, 0, 0.8, 0.0), (0.8, 0, 1.0, 0.1)],
)
def test_draws_follow_the_filtered_softmax(
    temperature: float, top_k: int, top_p: float, min_p: float
) -> None:
    n = 20_000
    logits = [1.2, 0.3, -0.5, 2.0, 0.9, -1.5, 0.0, 1.6]
    expected = expected_probs(logits, temperature, top_k, top_p, min_p)
    p = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    t = tensors([p] * n, seeds=[99] * n, positions=list(range(n)))
    drawn = sample(torch.tensor([logits] * n), t)
    counts = torch.bincount(drawn, minlength=8).tolist()
    support = [i for i, e in enumerate(expected) if e > 0]
    assert [c > 0 for c in counts] == [e > 0 for e in expected], counts  # filtered never drawn
    chi2 = sum((counts[i] - n * expected[i]) ** 2 / (n * expected[i]) for i in support)
    dof = len(support) - 1
    assert dof >= 2
    assert chi2 < CHI2_CRIT_001[dof], (chi2, counts, [round(n * e) for e in expected])
    torch.testing.assert_close(
        filtered_probs(torch.tensor([logits]), tensors([p]))[0],
        torch.tensor(expected, dtype=torch.float32),
    )


# -- logprobs ---------------------------------------------------------------------------


def test_top_logprobs_equal_log_softmax() -> None:
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 40, generator=gen) * 3
    tokens = torch.tensor([5, 0, 39])
    chosen, ids, values = top_logprobs(logits, tokens, 4)
    ref = torch.log_softmax(logits.double(), dim=-1)
    assert chosen.shape == (3,) and ids.shape == (3, 4) and values.shape == (3, 4)
    torch.testing.assert_close(chosen.double(), ref[torch.arange(3), tokens])
    assert ids.tolist() == ref.argsort(dim=-1, descending=True)[:, :4].tolist()
    torch.testing.assert_close(values.double(), ref.gather(-1, ids))
    assert (values[:, :-1] >= values[:, 1:]).all()


# -- hash helpers -----------------------------------------------------------------------


def _inv_xorshift(y: int, s: int) -> int:
    x = y
    for _ in range(32 // s + 1):
        x = y ^ (x >> s)
    return x & M32


def inv_hash32(y: int) -> int:
    """Inverse of ``hash32`` (lowbias32) on one 32-bit value."""
    x = _inv_xorshift(y, 16)
    x = (x * pow(0x846CA68B, -1, 2**32)) & M32
    x = _inv_xorshift(x, 15)
    x = (x * pow(0x7FEB352D, -1, 2**32)) & M32
    return _inv_xorshift(x, 16)


def test_hash32_matches_lowbias32_and_is_invertible() -> None:
    def lowbias32(x: int) -> int:
        x ^= x >> 16
        x = (x * 0x7FEB352D) & M32
        x ^= x >> 15
        x = (x * 0x846CA68B) & M32
        return x ^ (x >> 16)

    xs = [0, 1, 2, 0xDEADBEEF, M32, 0x80000000, 12345678]
    assert hash32(torch.tensor(xs)).tolist() == [lowbias32(x) for x in xs]
    assert [inv_hash32(lowbias32(x)) for x in xs] == xs


def test_uniform_and_keys_stay_in_range_for_extreme_seeds() -> None:
    seeds = torch.tensor([0, 1, 2**31, 2**32 - 1, 2**32, 2**62, 2**63 - 1, 2**63 - 2])
    positions = torch.tensor([0, 2**31, 2**32 - 1, 2**40, 5, 2**62, 2**63 - 1, 1])
    keys = row_keys(seeds, positions)
    assert keys.dtype == torch.int64
    assert ((keys >= 0) & (keys <= M32)).all()
    u = uniform(keys, 4096)
    assert u.shape == (8, 4096)
    assert ((u > 0) & (u < 1)).all()
    assert torch.isfinite(-torch.log(u)).all() and (-torch.log(u) > 0).all()
    big = torch.tensor([M32, 0, 2**31 + 7])
    assert ((hash32(big) >= 0) & (hash32(big) <= M32)).all()


def _key_whose_uniform_is_top(col: int) -> int:
    """A row key for which column ``col`` gets the largest 24-bit value, h >> 8 == 2**24 - 1."""
    return inv_hash32(inv_hash32(M32) ^ 0x5BD1E995) ^ col


def test_uniform_is_strictly_below_one_at_the_top_24_bit_value() -> None:
    # (2**24 - 1) + 0.5 is not representable in fp32 and rounds up to 2**24, so the
    # largest hash gave u == 1.0, a point at the total mass and a draw past the last token.
    key = _key_whose_uniform_is_top(0)
    h = hash32(hash32(torch.tensor([key])) ^ 0x5BD1E995)
    assert (h >> 8).item() == 2**24 - 1
    u = uniform(torch.tensor([key]), 1)
    assert u.item() < 1.0, "uniform() returned exactly 1.0"


def test_filtered_out_token_is_never_drawn_even_at_the_top_uniform() -> None:
    # A seed whose key at position 5 gives the top uniform: past every kept token's mass.
    key = _key_whose_uniform_is_top(0)
    seed = inv_hash32(inv_hash32(inv_hash32(key) ^ 5))  # row_keys(seed, 5) == key, high bits 0
    assert row_keys(torch.tensor([seed]), torch.tensor([5])).item() == key
    logits = torch.tensor([[5.0, 1.0, 0.0, -1.0, 0.5]])
    t = tensors([SamplingParams(temperature=1.0, top_k=1)], seeds=[seed], positions=[5])
    assert sample(logits, t).item() == 0


def _key_whose_uniform_is_bottom() -> int:
    """A row key whose first uniform is the smallest one, h >> 9 == 0."""
    return inv_hash32(inv_hash32(0) ^ 0x5BD1E995)


def test_draws_at_the_extreme_uniforms_skip_zero_weights() -> None:
    top, bottom = _key_whose_uniform_is_top(0), _key_whose_uniform_is_bottom()
    assert uniform(torch.tensor([bottom]), 1).item() == 0.5 / 2**23
    weights = torch.tensor([[0.0, 0.0, 1.0, 2.0, 0.0, 3.0, 0.0, 0.0]] * 2)
    assert draw(weights, torch.tensor([bottom, top])).tolist() == [2, 5]
    # Weight below fp32's resolution of the total: the cumulative weight tops out early,
    # and the draw is still a token with weight, never the zero tail.
    tiny_tail = torch.tensor([[0.0, 1.0, 1e-9, 0.0, 0.0]] * 2)
    assert draw(tiny_tail, torch.tensor([bottom, top])).tolist() == [1, 1]
    # Any total works (the residual of rejection sampling is not normalised); at a
    # subnormal total the top uniform times the total rounds up to the total itself.
    assert draw(weights * 1e-30, torch.tensor([bottom, top])).tolist() == [2, 5]
    subnormal = torch.tensor([[0.0, 1e-40, 0.0]])
    point = uniform(torch.tensor([top]), 1) * subnormal.sum()
    assert point.item() == subnormal.sum().item()
    assert draw(subnormal, torch.tensor([top])).tolist() == [1]


def test_unfiltered_row_keeps_its_whole_distribution_in_a_filtered_batch() -> None:
    # Another row's top-k sends the whole batch through the filter path; a row with
    # top_p == 1 must still get exactly softmax(logits), or batching changes its draws.
    # In fp32 the cumulative mass reaches 1.0 before the tail, and "mass_before < 1.0"
    # then drops tail tokens.
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 50_000, generator=gen) * 3
    t = tensors([SamplingParams(top_k=50), SamplingParams()])
    probs = filtered_probs(logits, t)
    dropped = int(((probs[1] == 0) & (torch.softmax(logits[1], dim=-1) > 0)).sum())
    assert dropped == 0, f"{dropped} tokens of an unfiltered row dropped"
    assert torch.equal(probs[1], filtered_probs(logits[1:], tensors([SamplingParams()]))[0])


# -- penalties and logit bias -----------------------------------------------------------

PENALTY_ROWS = [
    SamplingParams(frequency_penalty=0.7, presence_penalty=-0.4),
    SamplingParams(repetition_penalty=1.8),
    SamplingParams(logit_bias={3: -100.0, 0: 2.5, 17: 0.25}),
    SamplingParams(),  # no penalty, in a batch with them
    SamplingParams(
        frequency_penalty=-1.5,
        presence_penalty=2.0,
        repetition_penalty=0.6,
        logit_bias={5: 7.0, 4: -3.0},
        temperature=0.0,
    ),
]


def histories(num_rows: int, vocab: int, gen: torch.Generator) -> tuple[list[list[int]], list[int]]:
    """Per row prompt + output token ids (repeats included) and the prompt lengths."""
    ids = [torch.randint(0, vocab, (12 + 3 * r,), generator=gen).tolist() for r in range(num_rows)]
    return ids, [5 + r for r in range(num_rows)]


def test_penalized_logits_equal_a_plain_reference() -> None:
    gen = torch.Generator().manual_seed(5)
    vocab = 20
    logits = torch.randn(len(PENALTY_ROWS), vocab, generator=gen) * 3
    ids, num_prompt = histories(len(PENALTY_ROWS), vocab, gen)
    t = SamplingTensors.build(PENALTY_ROWS, [0] * 5, [0] * 5, CPU, ids, num_prompt)
    assert t.penalties is not None and t.penalties.rows.tolist() == [0, 1, 2, 4]
    ours = penalized(logits[:, None], t.penalties)[:, 0]
    for row, params in enumerate(PENALTY_ROWS):
        prompt, output = ids[row][: num_prompt[row]], ids[row][num_prompt[row] :]
        expected = reference_penalized(logits[row], prompt, output, params)
        assert torch.equal(ours[row], expected), row
    assert torch.equal(ours[3], logits[3])  # untouched, bit for bit


def test_each_verified_position_counts_the_drafts_before_it() -> None:
    """Position i of [B, K+1] verify logits sees output + drafts[:i] (drafts repeat tokens
    of the output and each other)."""
    gen = torch.Generator().manual_seed(6)
    vocab, k = 20, 4
    b = len(PENALTY_ROWS)
    logits = torch.randn(b, k + 1, vocab, generator=gen) * 2
    ids, num_prompt = histories(b, vocab, gen)
    drafts = torch.tensor([[ids[r][-1], 2, 2, ids[r][0]] for r in range(b)])
    t = SamplingTensors.build(PENALTY_ROWS, [0] * b, [0] * b, CPU, ids, num_prompt)
    ours = penalized(logits, t.penalties, drafts)
    for row, params in enumerate(PENALTY_ROWS):
        prompt, output = ids[row][: num_prompt[row]], ids[row][num_prompt[row] :]
        for i in range(k + 1):
            seen = output + drafts[row, :i].tolist()
            expected = reference_penalized(logits[row, i], prompt, seen, params)
            assert torch.equal(ours[row, i], expected), (row, i)


def test_repetition_penalty_equals_transformers_processor() -> None:
    from transformers import RepetitionPenaltyLogitsProcessor

    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(3, 30, generator=gen) * 4
    ids = torch.randint(0, 30, (3, 9), generator=gen)
    for penalty in (0.5, 1.3, 2.0):
        params = [SamplingParams(repetition_penalty=penalty)] * 3
        t = SamplingTensors.build(params, [0] * 3, [0] * 3, CPU, ids.tolist(), [4, 0, 9])
        hf = RepetitionPenaltyLogitsProcessor(penalty)(ids, logits.clone())
        assert torch.equal(penalized(logits[:, None], t.penalties)[:, 0], hf), penalty


def test_greedy_and_sampled_rows_pick_from_the_penalized_logits() -> None:
    logits = torch.tensor([[5.0, 4.0, 1.0, 0.0]] * 3)
    rows = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, logit_bias={0: -100.0}),
        SamplingParams(temperature=0.0, frequency_penalty=2.0, presence_penalty=0.5),
    ]
    ids = [[1, 0], [1, 0], [1, 0, 0]]  # row 2 has output [0, 0]: 5 - (4 + 0.5) < 4
    t = SamplingTensors.build(rows, [0] * 3, [0] * 3, CPU, ids, [1, 1, 1])
    assert sample(logits, t).tolist() == [0, 1, 1]
    # A sampled row whose bias leaves one token possible draws it, whatever the seed.
    only_2 = SamplingParams(logit_bias={0: -100.0, 1: -100.0, 3: -100.0}, top_k=2)
    t = SamplingTensors.build([only_2] * 64, list(range(64)), [9] * 64, CPU, [[1]] * 64, [1] * 64)
    assert set(sample(torch.tensor([[5.0, 4.0, 1.0, 0.0]] * 64), t).tolist()) == {2}


def test_rows_without_penalties_build_nothing() -> None:
    params = [SamplingParams(temperature=0.5, top_k=3), SamplingParams(temperature=0.0)]
    t = SamplingTensors.build(params, [0, 0], [0, 0], CPU, [[1, 2], [3]], [1, 1])
    assert t.penalties is None
    logits = torch.randn(2, 1, 8)
    assert penalized(logits, None) is logits
    # Without the rows' tokens (draft proposals), nothing is applied.
    t = SamplingTensors.build(PENALTY_ROWS[:1], [0], [0], CPU)
    assert t.penalties is None


def test_a_temperature_too_small_to_divide_by_samples_greedily() -> None:
    """1e-40 beside greedy rows: dividing by it made the row NaN, which drew id V (one past
    the vocabulary) and failed the whole batch in the draft's embedding."""
    vocab = 64
    logits = torch.randn(7, vocab, generator=torch.Generator().manual_seed(3)) * 10
    params = [SamplingParams(temperature=0.0)] * 6 + [SamplingParams(temperature=1e-40)]
    assert params[-1].is_greedy and not SamplingParams(temperature=1e-5).is_greedy
    t = SamplingTensors.build(params, [1] * 7, [0] * 7, torch.device("cpu"))
    assert t.all_greedy
    assert sample(logits, t).tolist() == logits.argmax(-1).tolist()
    mixed = [SamplingParams(temperature=1.0, seed=5), SamplingParams(temperature=1e-40)]
    t = SamplingTensors.build(mixed, [5, 1], [0, 0], torch.device("cpu"))
    picked = sample(logits[:2], t)
    assert picked[1] == logits[1].argmax() and 0 <= picked[0] < vocab


def test_nan_weights_never_draw_past_the_vocabulary() -> None:
    weights = torch.rand(3, 32)
    weights[1] = float("nan")
    weights[2, 5] = float("nan")
    drawn = draw(weights, torch.tensor([1, 2, 3]))
    assert drawn.shape == (3,) and bool(((drawn >= 0) & (drawn < 32)).all()), drawn

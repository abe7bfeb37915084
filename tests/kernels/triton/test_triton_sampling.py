"""Sampling and speculative acceptance kernels against their references and against the
engine's sampler and acceptance, with the same uniforms passed in (deterministic)."""

from __future__ import annotations

import torch

from engine.sampler import SamplingTensors, row_keys, uniform
from engine.sampler import filtered_probs as engine_filtered_probs
from engine.sampler import sample as engine_sample
from engine.spec.acceptance import _ACCEPT_SALT, accept, per_position
from kernels.reference import sampling as ref
from kernels.triton import sampling as tri

VOCAB = 40


def params(device: torch.device) -> dict[str, torch.Tensor]:
    """Six rows: top-k with top-p, top-p alone, top-k with min-p, greedy, top-k past the
    vocabulary with top-p and min-p, min-p alone."""
    return {
        "temperature": torch.tensor([0.7, 1.0, 1.3, 0.0, 1.0, 0.9], device=device),
        "top_k": torch.tensor([5, 0, 3, 0, 50, 0], device=device),
        "top_p": torch.tensor([0.9, 0.8, 1.0, 1.0, 0.5, 1.0], device=device),
        "min_p": torch.tensor([0.0, 0.0, 0.1, 0.0, 0.05, 0.2], device=device),
    }


def engine_tensors(p: dict[str, torch.Tensor], seeds: torch.Tensor, positions: torch.Tensor):
    return SamplingTensors(
        temperature=p["temperature"],
        top_k=p["top_k"],
        top_p=p["top_p"],
        min_p=p["min_p"],
        seeds=seeds,
        positions=positions,
        all_greedy=False,
        uses_top_k=True,
        uses_top_p=True,
        uses_min_p=True,
    )


def logits_for(rows: int, device: torch.device, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, VOCAB, generator=g) * 2
    logits[0, 3] = logits[0].max()  # a tie at the top: both kept
    logits[2, 5] = logits[2, 6] = logits[2].topk(3).values[-1]  # a tie at top-k's threshold
    return logits.to(device)


def test_filtered_probs_keep_the_engines_tokens(device) -> None:
    logits, p = logits_for(6, device), params(device)
    got = tri.filtered_probs(logits, **p)
    want = ref.filtered_probs(logits, **p)
    zeros = torch.zeros(6, dtype=torch.int64, device=device)
    engine = engine_filtered_probs(logits, engine_tensors(p, zeros, zeros))
    assert torch.equal(want > 0, engine > 0)
    torch.testing.assert_close(want, engine, rtol=0, atol=0)
    assert torch.equal(got > 0, want > 0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)  # exp: ulps apart
    kept = (got > 0).sum(-1).tolist()
    assert kept[0] >= 2 and kept[2] >= 4 and kept[3] == VOCAB  # ties kept; greedy unfiltered


def test_sample_equals_the_engines_seeded_sample(device) -> None:
    """The engine's keyed uniforms passed in: the same tokens, greedy rows their argmax."""
    logits, p = logits_for(6, device, seed=1), params(device)
    seeds = torch.arange(6, device=device) * 7919
    for step in range(4):
        positions = torch.full((6,), 10 + step, device=device)
        u = uniform(row_keys(seeds, positions), 1)[:, 0]
        want = engine_sample(logits, engine_tensors(p, seeds, positions))
        assert torch.equal(ref.sample(logits, **p, uniforms=u), want)
        assert torch.equal(tri.sample(logits, **p, uniforms=u), want)


def test_draw_never_picks_a_zero_weight_and_inverts_the_cdf(device) -> None:
    weights = torch.tensor(
        [[0.0, 1.0, 0.0, 3.0, 0.0], [2.0, 0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0, 5e-3]]
    ).to(device)
    for u, want in [(1e-7, [1, 0, 4]), (0.24, [1, 0, 4]), (0.26, [3, 0, 4]), (1 - 1e-7, [3, 0, 4])]:
        uniforms = torch.full((3,), u, device=device)
        assert tri.draw(weights, uniforms).tolist() == want
        assert ref.draw(weights, uniforms).tolist() == want


def spec_case(device: torch.device, k: int = 3, b: int = 5):
    """Peaked target logits, drafts that are often the target's likeliest token, draft
    distributions close to the target's."""
    g = torch.Generator().manual_seed(2)
    logits = (torch.randn(b, k + 1, VOCAB, generator=g) * 4).to(device)
    drafts = logits[:, :k].argmax(-1)
    drafts[1, 1] = (drafts[1, 1] + 1) % VOCAB  # a rejection inside the row
    draft_logits = logits[:, :k] + torch.randn(b, k, VOCAB, generator=g).to(device)
    seeds = torch.arange(b, device=device) * 104729 + 1
    first_positions = torch.arange(b, device=device) + 20
    return logits, drafts, draft_logits.softmax(-1), seeds, first_positions


def engine_inputs(logits, seeds, first_positions):
    """The engine's filtered p per position and the uniforms its acceptance keys."""
    b, s, v = logits.shape
    ones = torch.ones(b, device=logits.device)
    p = {"temperature": ones * 0.8, "top_k": (ones * 8).long(), "top_p": ones * 0.95,
         "min_p": ones * 0.0}  # fmt: skip
    sampling = engine_tensors(p, seeds, first_positions)
    positions = first_positions[:, None] + torch.arange(s, device=logits.device)
    flat = per_position(sampling, positions)
    probs = engine_filtered_probs(logits.reshape(b * s, v), flat).view(b, s, v)
    keys = row_keys(flat.seeds, flat.positions)
    draw_u = uniform(keys, 1).view(b, s)
    accept_u = uniform(keys.view(b, s)[:, :-1].reshape(-1) ^ _ACCEPT_SALT, 1).view(b, s - 1)
    return sampling, probs, draw_u, accept_u


def test_rejection_sampling_of_argmax_drafts_equals_the_engines_accept(device) -> None:
    logits, drafts, _, seeds, first = spec_case(device)
    sampling, probs, draw_u, _ = engine_inputs(logits, seeds, first)
    want = accept(logits, drafts, sampling, first)
    assert 0 < int(want[0].sum()) < 3 * drafts.shape[0]  # some accepted, some rejected
    for module in (ref, tri):
        num, nxt = module.rejection_sample(probs, drafts, draw_u)
        assert torch.equal(num, want[0]) and torch.equal(nxt, want[1])


def test_rejection_sampling_of_sampled_drafts_equals_the_engines_accept(device) -> None:
    logits, drafts, q, seeds, first = spec_case(device)
    sampling, probs, draw_u, accept_u = engine_inputs(logits, seeds, first)
    want = accept(logits, drafts, sampling, first, draft_probs=q)
    assert 0 < int(want[0].sum()) < 3 * drafts.shape[0]
    for module in (ref, tri):
        num, nxt = module.rejection_sample(probs, drafts, draw_u, q, accept_u)
        assert torch.equal(num, want[0]) and torch.equal(nxt, want[1])


def test_a_rejection_where_p_equals_q_draws_from_p(device) -> None:
    """max(0, p - q) has no mass when q == p: the residual falls back to p, as the engine."""
    g = torch.Generator().manual_seed(5)
    p = torch.randn(2, 2, VOCAB, generator=g).softmax(-1).to(device)
    drafts = torch.tensor([[3], [7]], device=device)
    draw_u = torch.tensor([[0.3, 0.6], [0.9, 0.1]], device=device)
    reject = torch.ones(2, 1, device=device)  # r * q(x) < p(x) fails: always rejected
    want = ref.rejection_sample(p, drafts, draw_u, p[:, :1], reject)
    got = tri.rejection_sample(p, drafts, draw_u, p[:, :1], reject)
    assert want[0].tolist() == [0, 0] and torch.equal(got[0], want[0])
    assert torch.equal(got[1], want[1])
    assert torch.equal(want[1], ref.draw(p[:, 0], draw_u[:, 0]))


def keyed_inputs(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Seeds across the whole int64 range (its ends and -1 included) and positions past
    2**32 (only their low 32 bits are hashed)."""
    g = torch.Generator().manual_seed(3)
    seeds = torch.randint(-(2**63), 2**63 - 1, (700,), generator=g, dtype=torch.int64)
    seeds[:4] = torch.tensor([0, -1, 2**63 - 1, -(2**63)])
    positions = torch.randint(0, 2**40, (700,), generator=g)
    return seeds.to(device), positions.to(device)


def test_keys_and_uniforms_are_the_references_bits_in_one_kernel_each(device) -> None:
    seeds, positions = keyed_inputs(device)
    keys = tri.row_keys(seeds, positions)
    assert torch.equal(keys, ref.row_keys(seeds, positions))
    for num in (1, 3):
        got = tri.uniform(keys, num)
        assert got.shape == (700, num) and torch.equal(got, ref.uniform(keys, num))
    assert tri.row_keys(seeds[:0], positions[:0]).shape == (0,)
    assert tri.uniform(keys[:0], 1).shape == (0, 1)

"""Suffix decoding: what a match proposes (exact tokens), the shared index's memory cap over
1,000 requests, and through the engine on a tiny random target: greedy output equals
target-only output with fixed and adaptive K, beside rows that opt out and rows with
logprobs; a cost table where drafts never pay runs plain steps."""

from __future__ import annotations

import tracemalloc

import pytest
import torch

from engine.engine_config import EngineConfig
from engine.sampler import SamplingTensors
from engine.spec.adaptive import AdaptiveK, StepCost
from engine.spec.config import SpeculativeConfig
from engine.spec.suffix import RequestIndex, SharedIndex, SuffixConfig, SuffixProposer
from engine.spec.unified_step import SpecStepInputs
from tests.engine.spec.test_spec_greedy import (
    PROMPTS,
    assert_counts_add_up,
    engine_for,
    greedy,
    run,
    run_where_drafts_never_pay,
)
from tests.engine.spec.test_spec_greedy import target as target

# Prompts that repeat themselves, as code edits do, and the tiny target's own loops.
REPEATING = [
    [5, 6, 7, 8, 9, 10, 11, 12, 5, 6, 7, 8],
    [20, 21, 22, 23, 24, 20, 21],
    [30, 31, 32, 33, 34, 35, 36, 37, 38, 30, 31, 32, 33],
]


def test_a_match_proposes_what_followed_it_as_far_as_it_supports():
    config = SuffixConfig(key_len=2, spec_factor=1.0)
    tokens = [5, 6, 7, 8, 9, 10, 11, 1, 2, 5, 6, 7]
    index = RequestIndex(tokens, config)
    proposal = index.propose(tokens, 5)
    # [5, 6, 7] matched: three tokens supported, and three follow it
    assert (proposal.tokens, proposal.match_len) == ([8, 9, 10], 3)
    tokens.append(8)  # the index reads the live list as it grows
    assert index.propose(tokens, 5).tokens == [9, 10, 11, 1]
    assert index.propose(tokens, 2).tokens == [9, 10]  # K bounds it
    assert index.propose([4, 4, 4], 5).tokens == []  # no key: nothing


def test_the_longest_match_wins_and_shares_end_a_proposal():
    config = SuffixConfig(key_len=1, spec_factor=4.0, min_token_prob=0.3)
    # After "0 1 2": "3 4" twice, "3 9" once; after "7 2": "8"
    tokens = [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1, 2, 3, 9, 0, 7, 2, 8, 0, 1, 2]
    proposal = RequestIndex(tokens, config).propose(tokens, 8)
    assert proposal.match_len == 3  # "0 1 2", not "7 2"
    # 3 (all three agree), then 4 (2 of 3), then 0 (both of those): 1 * 2/3 * 1 >= 0.3
    assert proposal.tokens[:3] == [3, 4, 0]
    assert proposal.probs[:3] == [1.0, pytest.approx(2 / 3), 1.0]
    strict = RequestIndex(tokens, SuffixConfig(key_len=1, spec_factor=4.0, min_token_prob=0.7))
    assert strict.propose(tokens, 8).tokens == [3]  # 2/3 < 0.7 stops at the split


def test_the_shared_index_proposes_from_earlier_outputs_and_the_longer_match_wins():
    proposer = SuffixProposer(SuffixConfig(key_len=2))
    proposer.finished([40, 41, 42, 43, 44, 45, 46, 47])
    own = proposer.request_index([1, 2, 3, 40, 41, 42, 43])  # matches 4 of the output
    assert proposer.propose(own, 3).tokens == [44, 45, 46]
    mine = proposer.request_index([42, 43, 9, 9, 42, 43])  # its own match is as long: its own
    # "42 43" matches 2 tokens in both: its own proposes, 2 tokens
    assert proposer.propose(mine, 3).tokens == [9, 9]
    assert proposer.propose(proposer.request_index([7, 8]), 3).tokens == []


def test_the_shared_index_stays_under_its_cap_over_1000_requests():
    """Its tokens never pass the cap, its entries are exactly its documents' keys, and its
    memory, measured, stays what a cap's worth of outputs costs."""
    cap = 20_000
    shared = SharedIndex(SuffixConfig(key_len=2, shared_tokens=cap))
    tracemalloc.start()
    try:
        base, _ = tracemalloc.get_traced_memory()
        peak_after_full = 0
        for i in range(1000):
            # 100 to 400 tokens over a vocabulary of 49,999: keys mostly distinct
            output = [(i * 7919 + j * 104729) % 49999 for j in range(100 + (i * 37) % 300)]
            shared.add(output)
            assert shared.num_tokens <= cap
            if i == 199:
                full, _ = tracemalloc.get_traced_memory()
            if i >= 200:
                peak_after_full = max(peak_after_full, tracemalloc.get_traced_memory()[0])
    finally:
        tracemalloc.stop()
    assert shared.num_tokens == sum(len(d) for d in shared.docs.values()) > cap - 400
    # one entry per indexed position of the kept documents: dropped ones left none behind
    assert shared.num_entries == sum(len(d) - 2 for d in shared.docs.values())
    # 800 more requests after it filled: memory stays what the first 200 filled it to
    assert peak_after_full - base < 1.25 * (full - base)
    assert (full - base) / cap < 400  # bytes per token kept


def test_dropped_outputs_leave_no_occurrence_behind_when_keys_repeat():
    """A vocabulary of 7: every key recurs far more than ``max_occurrences`` times, so
    lists are truncated as outputs come and go; every occurrence left is of a kept
    output, and proposals still come from them."""
    config = SuffixConfig(key_len=2, shared_tokens=500, max_occurrences=4)
    shared = SharedIndex(config)
    for i in range(300):
        shared.add([(i + j * j) % 7 for j in range(40 + i % 30)])
        assert shared.num_tokens <= 500
    kept = {id(d) for d in shared.docs.values()}
    found = [o for occurrences in shared.entries.values() for o in occurrences]
    assert found and all(id(tokens) in kept for tokens, _ in found)
    assert all(len(occurrences) <= 4 for occurrences in shared.entries.values())
    assert shared.propose([0, 1, 4, 2], 3).tokens  # "4 2" recurs


def test_a_long_prompt_is_indexed_over_its_last_tokens_only():
    config = SuffixConfig(key_len=2, request_tokens=100)
    tokens = [1, 2, 3, 4, 5] + [9] * 995 + [1, 2]  # "1 2 3 ..." is 1,000 tokens back
    index = RequestIndex(tokens, config)
    assert index.propose(tokens, 3).tokens == []  # out of reach
    assert sum(len(o) for o in index.entries.values()) <= 100
    whole = RequestIndex(tokens, SuffixConfig(key_len=2))
    assert whole.propose(tokens, 3).tokens == [3, 4]  # "1 2" matched: two tokens


def test_proposing_from_a_shared_output_keeps_it_longest():
    shared = SharedIndex(SuffixConfig(key_len=2, shared_tokens=30))
    shared.add(list(range(100, 110)))
    shared.add(list(range(200, 210)))
    proposal = shared.propose([100, 101, 102], 3)
    assert proposal.tokens == [103, 104, 105]  # "100 101 102" matched: 3 tokens
    shared.touch(proposal.source)
    shared.add(list(range(300, 315)))  # 35 tokens: the least recently used goes
    assert sorted(d[0] for d in shared.docs.values()) == [100, 300]


def suffix(k: int = 4, **kw) -> SpeculativeConfig:
    return SpeculativeConfig("", num_draft_tokens=k, kind="suffix", **kw)


@pytest.mark.parametrize("adaptive", [False, True], ids=["fixed", "adaptive"])
def test_greedy_with_suffix_drafts_equals_target_only(target, adaptive):
    model_dir, _ = target
    prompts = PROMPTS + REPEATING
    requests = {str(i): (p, greedy(40)) for i, p in enumerate(prompts)}
    requests["logprobs"] = (REPEATING[0], greedy(30, logprobs=2))
    requests["opted_out"] = (REPEATING[1], greedy(30, speculative=False))
    base = run(engine_for(model_dir), requests)
    engine = engine_for(model_dir, suffix(adaptive=adaptive), max_num_seqs=16)
    assert engine.spec is not None and engine.spec.kind == "suffix"
    assert "draft" not in engine.kv_pools  # no draft model, no draft KV
    if adaptive:  # measured at start-up; injected costs where drafts pay: no timing decides
        measured = engine.spec.adaptive
        assert measured is not None and measured.buckets == [1, 2, 4, 8, 16]
        cheap = {k: StepCost(1.0 + 0.01 * k) for k in range(5)}
        engine.spec.adaptive = AdaptiveK(range(5), dict.fromkeys(measured.buckets, cheap))
    out = run(engine, requests)
    assert {r: o.token_ids for r, o in out.items()} == {r: o.token_ids for r, o in base.items()}
    assert [t.logprob for t in out["logprobs"].logprobs] == pytest.approx(
        [t.logprob for t in base["logprobs"].logprobs], abs=1e-4
    )
    stats = engine.spec.stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert_counts_add_up(engine, out)
    off = out["opted_out"].spec_counts
    assert off is not None and (off.num_drafts, off.num_steps_without_drafts) == (0, 30 - 1)
    # each decode step verifies as deep as its longest proposal, at most K
    assert len(stats.steps_per_k) <= 5
    # the requests' outputs were kept for later ones; the warm-up's were forgotten
    assert engine.spec.proposer.shared.num_tokens == sum(  # type: ignore[attr-defined]
        len(o.token_ids) for o in out.values() if len(o.token_ids) > 2
    )


def test_a_later_request_drafts_from_an_earlier_ones_output_through_the_shared_index(target):
    """A prompt that ends where an earlier output began continues as that output did: with
    the shared index its drafts come from it, and more of them are accepted than from its
    own tokens alone (``shared_tokens=0``). Output stays the target's either way."""
    model_dir, _ = target
    first = {"first": (PROMPTS[3], greedy(40))}
    output = run(engine_for(model_dir), first)["first"].token_ids
    later = {"later": (PROMPTS[3] + output[:8], greedy(24))}
    base = run(engine_for(model_dir), later)["later"].token_ids
    accepted = {}
    for cap in (0, 1 << 18):
        engine = engine_for(model_dir, suffix(k=4, suffix=SuffixConfig(shared_tokens=cap)))
        assert run(engine, first)["first"].token_ids == output
        before = engine.spec.stats.num_accepted_tokens  # type: ignore[union-attr]
        assert run(engine, later)["later"].token_ids == base
        accepted[cap] = engine.spec.stats.num_accepted_tokens - before  # type: ignore[union-attr]
    assert accepted[1 << 18] > accepted[0]


def test_a_cost_table_where_suffix_drafts_never_pay_runs_plain_steps(target):
    """Injected costs, not timings: every row has a proposal, and none is verified."""
    model_dir, _ = target
    requests = {"0": (REPEATING[0], greedy(16))}
    base = run(engine_for(model_dir), requests)
    engine = engine_for(model_dir, suffix(k=3))
    assert engine.spec is not None
    # the prompt alone supports drafts from the first step
    assert RequestIndex(REPEATING[0], SuffixConfig()).propose(REPEATING[0], 3).tokens == [9, 10, 11]
    run_where_drafts_never_pay(engine, requests, base)
    assert engine.spec.stats.steps_per_k == [16 - 1]


def test_an_idle_engine_times_a_stale_bucket_again_on_blocks_nothing_needs(target):
    """Steps at contexts longer than the costs were measured at make the bucket stale; the
    idle engine times it again, one K per call, on clean free blocks only: a cached prefix
    still serves a later request exactly."""
    model_dir, _ = target
    requests = {"0": (REPEATING[2] * 2, greedy(24))}
    base = run(engine_for(model_dir), requests)
    engine = engine_for(model_dir, suffix(k=2, adaptive=True), max_num_seqs=2)
    assert engine.spec is not None and engine.spec.adaptive is not None
    adaptive, refresh = engine.spec.adaptive, engine.spec.refresh
    assert refresh is not None and not engine.wants_cost_refresh()
    adaptive.measured = dict.fromkeys(adaptive.measured, 8.0)  # as if timed at 8 tokens only
    assert run(engine, requests)["0"].token_ids == base["0"].token_ids
    assert adaptive.stale.get(1, 0) > 12  # its steps ran at 26 tokens and more
    cached = engine.block_manager.num_free_blocks - engine.block_manager.num_clean_blocks
    assert cached > 0  # the request's prefix stays cached
    spent = []
    while engine.wants_cost_refresh():
        spent.append(engine.refresh_costs())
    assert len(spent) == 3 and all(s > 0 for s in spent)  # K = 0, 1, 2
    assert refresh.num_refreshed == 1 and adaptive.measured[1] > 12 and 1 not in adaptive.stale
    again = run(engine, {"1": requests["0"]})
    assert again["1"].token_ids == base["0"].token_ids and again["1"].num_cached_tokens > 0


def test_cuda_graphs_and_overlap_are_refused_with_suffix_drafts():
    with pytest.raises(ValueError, match="cuda_graphs: suffix drafts verify rows of different"):
        EngineConfig(model="m", speculative=suffix(), cuda_graphs=True)
    with pytest.raises(ValueError, match="enable_overlap_scheduler: does not support suffix"):
        EngineConfig(model="m", speculative=suffix(), enable_overlap_scheduler=True)
    assert not EngineConfig(model="m", device="cuda", speculative=suffix()).uses_cuda_graphs


def test_a_packed_greedy_step_decides_from_the_argmax_as_from_padded_logits(target):
    """Rows of 3, 0, 2 and 1 drafts, each accepted up to a chosen point (drafts built one
    position at a time from the target's own argmax, then one wrong): the step that skips
    padding the logits (no row reads them) accepts and emits exactly what the padded one
    does, and returns no logits."""
    model_dir, _ = target
    engine = engine_for(model_dir, suffix(k=3))
    spec = engine.spec
    assert spec is not None
    lengths, keep = [3, 0, 2, 1], [2, 0, 2, 0]  # drafts per row; how many to make right
    b, k = len(lengths), max(lengths)
    blocks = torch.tensor(engine.block_manager.clean_block_ids[: b * 4]).view(b, 4)

    def step(drafts: torch.Tensor, return_logits: bool):
        inputs = SpecStepInputs(
            tokens=torch.tensor([5, 9, 13, 17]),
            draft_tokens=drafts,
            kv_lens=torch.zeros(b, dtype=torch.int64),
            block_tables=blocks,
            sampling=SamplingTensors.build([greedy(1)] * b, [0] * b, [1] * b, torch.device("cpu")),
            max_context_len=12,
            draft_lengths=torch.tensor(lengths),
            packed_lengths=lengths,
            return_logits=return_logits,
        )
        return spec.step(inputs, 0)

    drafts = torch.full((b, k), 7, dtype=torch.int64)
    for j in range(k):  # position j's argmax becomes draft j where it is kept right
        argmax = step(drafts, True).logits.argmax(dim=-1)
        for row in range(b):
            if j < keep[row]:
                drafts[row, j] = argmax[row, j]
            elif j < lengths[row]:
                drafts[row, j] = (argmax[row, j] + 1) % 64  # wrong
    padded, lean = step(drafts, True), step(drafts, False)
    assert padded.num_accepted.tolist() == keep
    assert lean.num_accepted.tolist() == keep
    assert torch.equal(lean.next_tokens, padded.next_tokens)
    assert torch.equal(lean.emitted, padded.emitted)
    assert lean.logits.shape == (b, 0, padded.logits.shape[-1])

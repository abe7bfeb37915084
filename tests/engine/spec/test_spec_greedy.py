"""Speculative decoding on tiny random targets: greedy output equals target-only output for
every drafter and K, and the edge cases of accepting many drafts at once."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from engine.llm_engine import EngineConfig, LLMEngine, RequestOutput
from engine.sampling_params import SamplingParams
from engine.sequence import SpecCounts
from engine.spec.adaptive import AdaptiveK, StepCost
from engine.spec.config import SpeculativeConfig
from tests.comparator import compare_greedy
from tests.engine.tiny_drafts import build_random_draft
from tests.engine.tiny_models import build_tiny_llama

PROMPTS = [[5, 6, 7], [9] * 11, [3, 4], [10, 11, 12, 13, 14, 15, 16], [40], [1, 2, 3, 4, 5, 6]]


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory):
    out = tmp_path_factory.mktemp("spec_target")
    model = build_tiny_llama(out, "gqa3_llama3rope_tied_bias_hd40", num_layers=3, vocab_size=64)
    return out, model


def engine_for(model_dir: Path, spec: SpeculativeConfig | None = None, **kw) -> LLMEngine:
    cfg = dict(model=str(model_dir), dtype="float32", kv_cache_memory=1 << 21, block_size=4)
    cfg.update(kw)
    return LLMEngine(EngineConfig(**cfg, speculative=spec))


def run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]):
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    done: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return done


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


def assert_counts_add_up(engine: LLMEngine, outputs: dict[str, RequestOutput]) -> None:
    """Each request's speculative counters (its usage on the wire) are its share of the
    engine's: they sum to them exactly."""
    assert engine.spec is not None
    counts = [o.spec_counts for o in outputs.values()]
    assert all(c is not None and c.num_accepted_tokens <= c.num_draft_tokens for c in counts)
    stats = engine.spec.stats
    for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        assert sum(getattr(c, name) for c in counts) == getattr(stats, name), name


@pytest.mark.parametrize("kind", ["eagle", "eagle3", "dflash"])
def test_greedy_equals_target_only_for_random_drafts(target, tmp_path, kind):
    model_dir, hf_model = target
    requests = {str(i): (p, greedy(24 + 3 * i)) for i, p in enumerate(PROMPTS)}
    base = run(engine_for(model_dir), requests)
    # EAGLE-3 with a reduced draft vocabulary: every other target id.
    d2t = torch.arange(32) if kind == "eagle3" else None
    extra = {"draft_vocab_size": 32} if kind == "eagle3" else {}
    draft = build_random_draft(model_dir, tmp_path / kind, kind, d2t=d2t, **extra)
    depths = [3] if kind == "dflash" else [1, 3, 5]  # DFlash: block_size - 1
    for k in depths:
        engine = engine_for(model_dir, SpeculativeConfig(str(draft), num_draft_tokens=k))
        out = run(engine, requests)
        assert engine.spec is not None and engine.spec.k == k
        assert engine.spec.stats.num_draft_tokens > 0
        assert_counts_add_up(engine, out)
        ours = [out[r].token_ids for r in requests]
        refs = [base[r].token_ids for r in requests]
        assert ours == refs or compare_greedy(hf_model, PROMPTS, ours, refs).num_ties <= 1


def markov_target(out: Path, vocab_size: int = 64):
    """A one-layer target whose next token depends only on the current one (attention
    output zeroed, final norm weight 1), and an EAGLE draft that reproduces it exactly:
    ``fc`` keeps the token embedding and the draft layer is the target's layer."""
    model = build_tiny_llama(out / "target", "mha_plain", num_layers=1, vocab_size=vocab_size)
    with torch.no_grad():
        model.model.layers[0].self_attn.o_proj.weight.zero_()
        model.model.norm.weight.fill_(1.0)
    model.save_pretrained(out / "target")
    from engine.registry import load_model
    from engine.spec.drafters import new_drafter, save_drafter
    from tests.engine.tiny_drafts import draft_hf_config

    ours, _ = load_model(out / "target", dtype="float32")
    hf = draft_hf_config(out / "target", "eagle")
    drafter = new_drafter("eagle", hf, ours, torch.device("cpu"))  # type: ignore[arg-type]
    h = hf["hidden_size"]
    with torch.no_grad():
        drafter.fc.weight.zero_()  # type: ignore[attr-defined]
        drafter.fc.weight[:, :h] = torch.eye(h)  # type: ignore[attr-defined]
        drafter.fc.bias.zero_()  # type: ignore[attr-defined]
        drafter.layer.load_state_dict(ours.layers[0].state_dict(), strict=False)  # type: ignore[attr-defined]
    save_drafter(drafter, out / "eagle", hf)
    return out / "target", out / "eagle", model


@pytest.fixture(scope="module")
def markov(tmp_path_factory: pytest.TempPathFactory):
    return markov_target(tmp_path_factory.mktemp("markov"))


def test_oracle_draft_accepts_everything(markov):
    target_dir, draft_dir, _ = markov
    requests = {str(i): (p, greedy(30)) for i, p in enumerate(PROMPTS)}
    base = run(engine_for(target_dir), requests)
    engine = engine_for(target_dir, SpeculativeConfig(str(draft_dir), num_draft_tokens=4))
    out = run(engine, requests)
    assert {r: o.token_ids for r, o in out.items()} == {r: o.token_ids for r, o in base.items()}
    stats = engine.spec.stats  # type: ignore[union-attr]
    # 29 tokens after the prefill's first one: 5 per step, so 6 steps, the last one cut.
    assert stats.num_drafts == 6 * len(PROMPTS)
    assert stats.num_accepted_tokens == stats.num_draft_tokens
    assert stats.mean_accepted_length == 5.0


def test_stops_inside_accepted_drafts(markov):
    """EOS, a stop token and max_tokens that fall inside a block of accepted drafts end the
    request exactly where target-only decoding ends it; other rows go on."""
    target_dir, draft_dir, _ = markov
    spec = SpeculativeConfig(str(draft_dir), num_draft_tokens=4)
    base = run(engine_for(target_dir), {"a": (PROMPTS[3], greedy(30))})["a"].token_ids
    stop = base[6]  # the 7th output token: in the middle of the second verified block
    first = base.index(stop)
    requests = {
        "stop_token": (PROMPTS[3], greedy(30, stop_token_ids=[stop])),
        "max_tokens": (PROMPTS[3], greedy(7)),
        "long": (PROMPTS[3], greedy(30)),
    }
    for spec_or_none in (None, spec):
        out = run(engine_for(target_dir, spec_or_none), requests)
        assert out["stop_token"].token_ids == base[: first + 1]
        assert (out["stop_token"].finish_reason, out["stop_token"].stop_reason) == ("stop", stop)
        assert out["max_tokens"].token_ids == base[:7]
        assert out["max_tokens"].finish_reason == "length"
        assert out["long"].token_ids == base
    engine = engine_for(target_dir, spec)
    engine.stops.eos_token_ids = frozenset({stop})
    out = run(engine, {"eos": (PROMPTS[3], SamplingParams(max_tokens=30, temperature=0.0))})
    assert out["eos"].token_ids == base[: first + 1] and out["eos"].finish_reason == "stop"


def test_mixed_greedy_and_seeded_rows_match_target_only(markov, target, tmp_path):
    """With argmax drafts, a seeded sampled row draws exactly what it draws without
    speculation (random numbers are keyed on seed and position), in a batch with greedy
    rows and rows of other lengths; logprobs come out for every emitted token."""
    model_dir, _ = target
    draft = build_random_draft(model_dir, tmp_path / "eagle", "eagle", std=0.2)
    requests = {
        "g0": (PROMPTS[0], greedy(20)),
        "s1": (
            PROMPTS[1],
            SamplingParams(max_tokens=25, temperature=0.8, seed=7, ignore_eos=True, logprobs=2),
        ),
        "s2": (
            PROMPTS[2],
            SamplingParams(max_tokens=18, temperature=1.0, top_k=5, seed=3, ignore_eos=True),
        ),
        "s3": (
            PROMPTS[3],
            SamplingParams(max_tokens=22, temperature=0.7, top_p=0.8, seed=11, ignore_eos=True),
        ),
        "g4": (PROMPTS[4], greedy(9)),
    }
    base = run(engine_for(model_dir), requests)
    out = run(engine_for(model_dir, SpeculativeConfig(str(draft), num_draft_tokens=3)), requests)
    for rid in requests:
        assert out[rid].token_ids == base[rid].token_ids, rid
    assert [lp.token_id for lp in out["s1"].logprobs] == out["s1"].token_ids
    for ours, theirs in zip(out["s1"].logprobs, base["s1"].logprobs, strict=True):
        assert ours.logprob == pytest.approx(theirs.logprob, abs=1e-4)
        assert set(ours.top) == set(theirs.top)


def test_preemption_and_prefix_reuse_stay_lossless(target, tmp_path):
    """A cache too small for every row preempts by recompute; drafts are rebuilt after it."""
    model_dir, _ = target
    draft = build_random_draft(model_dir, tmp_path / "eagle3", "eagle3")
    requests = {str(i): ([7, 8, 9, 10, *p], greedy(40)) for i, p in enumerate(PROMPTS)}
    base = run(engine_for(model_dir), requests)
    assert all(o.spec_counts is None for o in base.values())  # no draft, no counters
    # 26 blocks (4 slots x 4 layers (3 target, 1 draft) x K,V x 2 heads x 40 dims x fp32):
    # one row at full length needs 16, so rows preempt each other.
    block_bytes = 4 * 4 * 2 * 2 * 40 * 4
    spec = SpeculativeConfig(str(draft), num_draft_tokens=3)
    engine = engine_for(model_dir, spec, kv_cache_memory=26 * block_bytes)
    assert engine.block_manager.num_blocks == 26
    out = run(engine, requests)
    assert engine.scheduler.num_preemptions > 0
    assert {r: o.token_ids for r, o in out.items()} == {r: o.token_ids for r, o in base.items()}
    assert_counts_add_up(engine, out)  # a preempted request keeps its counters


def test_adaptive_k_is_lossless_and_measures_every_bucket(target, tmp_path):
    """Adaptive speculation measures a step cost per batch bucket and K (0 included) at
    start-up, picks K per step from them, and stays lossless."""
    model_dir, _ = target
    draft = build_random_draft(model_dir, tmp_path / "eagle3", "eagle3")
    requests = {str(i): (p, greedy(20)) for i, p in enumerate(PROMPTS)}
    base = run(engine_for(model_dir), requests)
    spec = SpeculativeConfig(str(draft), num_draft_tokens=3, adaptive=True)
    engine = engine_for(model_dir, spec, max_num_seqs=8)
    adaptive = engine.spec.adaptive  # type: ignore[union-attr]
    assert adaptive is not None and adaptive.buckets == [1, 2, 4, 8]
    assert all(sorted(adaptive.costs[b]) == [0, 1, 2, 3] for b in adaptive.buckets)
    out = run(engine, requests)
    assert {r: o.token_ids for r, o in out.items()} == {r: o.token_ids for r, o in base.items()}
    assert adaptive.overhead > 0  # the engine's time between decode steps was seen


def test_a_cost_table_where_drafts_never_pay_runs_plain_steps_and_says_so(target, tmp_path):
    """Injected costs, not timings: where every K > 0 costs more per expected token than a
    plain step, every step, the prompt's proposal included, runs at K = 0. The output
    stays the target's; the request's counters and the engine's steps per K say so."""
    model_dir, _ = target
    draft = build_random_draft(model_dir, tmp_path / "eagle3", "eagle3")
    requests = {"0": (PROMPTS[0], greedy(12))}
    base = run(engine_for(model_dir), requests)
    engine = engine_for(model_dir, SpeculativeConfig(str(draft), num_draft_tokens=3))
    counts = run_where_drafts_never_pay(engine, requests, base)
    assert counts.num_steps_without_drafts == 12 - 1  # the prompt's step made the first
    assert engine.spec.stats.steps_per_k == [11]  # type: ignore[union-attr]


def run_where_drafts_never_pay(
    engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]], base: dict
) -> SpecCounts:
    """Runs request "0" at batch 1 with injected K=0..3 costs where no K > 0 pays: output
    equals ``base``'s, no draft is verified; the request's counters."""
    assert engine.spec is not None
    dear = {0: StepCost(1.0), 1: StepCost(3.0), 2: StepCost(4.0), 3: StepCost(5.0)}
    engine.spec.adaptive = AdaptiveK([0, 1, 2, 3], {1: dear}, probe_budget=0.0)
    out = run(engine, requests)
    assert out["0"].token_ids == base["0"].token_ids
    counts = out["0"].spec_counts
    assert counts is not None and (counts.num_drafts, counts.num_draft_tokens) == (0, 0)
    return counts


@pytest.mark.parametrize("sample_drafts", [False, True], ids=["argmax_drafts", "sampled_drafts"])
def test_a_request_that_does_not_speculate_emits_what_plain_decoding_does(
    target, tmp_path, sample_drafts
):
    """Rows of requests with ``speculative=False`` verify no drafts in the same batches as
    rows that do: greedy ones emit the target's tokens, seeded sampled ones the very tokens
    decoding without a draft samples (with sampled drafts, speculating rows draw otherwise,
    so only this says the padding rows took the plain path). Their counters say so."""
    model_dir, _ = target
    draft = build_random_draft(model_dir, tmp_path / "eagle3", "eagle3", std=0.3)

    def sampled(n: int, **kw: object) -> SamplingParams:
        return SamplingParams(
            max_tokens=n, temperature=0.9, top_k=20, seed=7, ignore_eos=True, **kw
        )

    requests = {
        "greedy-on": (PROMPTS[0], greedy(16)),
        "greedy-off": (PROMPTS[1], greedy(16, speculative=False)),
        "sampled-on": (PROMPTS[2], sampled(16)),
        "sampled-off": (PROMPTS[3], sampled(16, speculative=False)),
    }
    base = run(engine_for(model_dir), requests)
    spec = SpeculativeConfig(str(draft), num_draft_tokens=3, sample_drafts=sample_drafts)
    engine = engine_for(model_dir, spec)
    out = run(engine, requests)
    for rid in ("greedy-on", "greedy-off", "sampled-off"):
        assert out[rid].token_ids == base[rid].token_ids, rid
    if not sample_drafts:  # argmax drafts draw exactly what plain sampling draws
        assert out["sampled-on"].token_ids == base["sampled-on"].token_ids
    for rid in ("greedy-off", "sampled-off"):
        counts = out[rid].spec_counts
        assert counts is not None and (counts.num_drafts, counts.num_draft_tokens) == (0, 0)
        assert counts.num_steps_without_drafts == 16 - 1, rid  # the prompt's step made one
    assert out["greedy-on"].spec_counts.num_drafts > 0  # type: ignore[union-attr]
    assert_counts_add_up(engine, out)


class ScriptedK(AdaptiveK):
    """K per step from a fixed cycle: a stand-in for the cost model in a test of the runner."""

    def __init__(self, ks: list[int]) -> None:
        super().__init__(sorted(set(ks)), {1: dict.fromkeys(ks, StepCost(1.0))})
        self.ks = itertools.cycle(ks)

    def choose(self, batch_size: int, context: float = 0.0) -> int:
        return next(self.ks)

    def observe_cost(self, batch_size: int, k: int, seconds: float, context: float = 0.0) -> None:
        pass


def draft_kv_of(engine: LLMEngine, request_id: str, num_positions: int) -> list[torch.Tensor]:
    """The draft pool's K and V of a running request's first ``num_positions`` positions."""
    seq = engine._seqs[request_id]
    bs = engine.runner.block_size
    positions = torch.arange(num_positions)
    blocks = torch.tensor(seq.block_table, dtype=torch.int64)[positions // bs]
    offsets = positions % bs
    assert engine.spec is not None
    return [pool[blocks, offsets] for layer in engine.spec.draft_kv.layers for pool in layer]


@pytest.mark.parametrize(
    ("max_undrafted", "schedule"),
    [(256, [0, 0, 3, 0, 0, 0, 1, 2, 0, 3, 3, 0, 0]), (3, [3, 1] + [0] * 10)],
)
def test_steps_without_drafts_leave_the_drafter_idle_until_drafting_resumes(
    target, tmp_path, max_undrafted, schedule
):
    """A step at K = 0 skips the drafter and keeps the target features; when drafting
    resumes, one batched extend writes the draft KV those steps skipped. Lockstep against
    an engine that runs the drafter every step: the same drafts every step, the same draft
    KV wherever it is written, the same output; prefix-cached blocks never hold a position
    whose draft KV is still missing. A row that kept ``max_undrafted`` positions catches up
    even while no drafts are asked for."""
    model_dir, hf_model = target
    draft = build_random_draft(model_dir, tmp_path / "eagle3", "eagle3")
    requests = {str(i): (p, greedy(26 + i)) for i, p in enumerate(PROMPTS)}
    base = run(engine_for(model_dir), requests)
    deferring, eager = (
        engine_for(model_dir, SpeculativeConfig(str(draft), num_draft_tokens=3), max_num_seqs=4)
        for _ in range(2)
    )
    assert deferring.spec is not None and eager.spec is not None
    deferring.spec.adaptive, eager.spec.adaptive = ScriptedK(schedule), ScriptedK(schedule)
    deferring.spec.max_undrafted = max_undrafted
    eager.spec.defer_drafter = False
    for engine in (deferring, eager):
        for rid, (prompt, params) in requests.items():
            engine.add_request(rid, prompt, params)
    done: dict[str, RequestOutput] = {}
    max_lag = 0
    while deferring.has_unfinished_requests():
        outs = deferring.step()
        assert [(o.request_id, o.token_ids) for o in outs] == [
            (o.request_id, o.token_ids) for o in eager.step()
        ]
        done.update((o.request_id, o) for o in outs if o.finished)
        for rid, seq in deferring._seqs.items():
            theirs = eager._seqs[rid]
            assert seq.draft_token_ids == theirs.draft_token_ids
            assert theirs.num_drafted_tokens == theirs.num_computed_tokens
            max_lag = max(max_lag, seq.num_computed_tokens - seq.num_drafted_tokens)
            assert seq.num_undrafted_tokens == sum(len(f) for f in seq.undrafted_features)
            assert len(seq.block_hashes) * deferring.runner.block_size <= seq.num_drafted_tokens
            for ours_kv, theirs_kv in zip(
                draft_kv_of(deferring, rid, seq.num_drafted_tokens),
                draft_kv_of(eager, rid, seq.num_drafted_tokens),
                strict=True,
            ):
                torch.testing.assert_close(ours_kv, theirs_kv, rtol=1e-5, atol=1e-5)
    assert not eager.has_unfinished_requests()
    assert max_lag >= 3  # rows went several steps without draft KV
    if max_undrafted == 3:  # 10 steps at K=0 in a row, but caught up at 3 positions:
        assert max_lag <= 2 + 1  # a K=0 step adds one (after K=1, at most two)
    assert deferring.spec.stats.num_caught_up_positions > 0
    assert eager.spec.stats.num_caught_up_positions == 0
    ours = [done[r].token_ids for r in requests]
    refs = [base[r].token_ids for r in requests]
    assert ours == refs or compare_greedy(hf_model, PROMPTS, ours, refs).num_ties <= 1


def test_penalties_with_speculation_equal_target_only(markov, target, tmp_path):
    """Verification applies logit bias and penalties at every position, counting the drafts
    before it as output: greedy rows and seeded sampled rows (argmax drafts) emit what
    target-only decoding emits. The oracle draft proposes the unpenalized argmax, so the
    penalties make verification reject some of its drafts."""
    settings = {
        "frequency": greedy(30, frequency_penalty=0.9),
        "presence": greedy(30, presence_penalty=1.5, logit_bias={3: 2.0}),
        "repetition": greedy(30, repetition_penalty=1.6),
        "sampled": SamplingParams(
            max_tokens=30, temperature=0.8, seed=5, ignore_eos=True,
            frequency_penalty=0.6, repetition_penalty=1.2, logit_bias={7: -100.0},
        ),
        "plain": greedy(30),
    }  # fmt: skip
    requests = {f"{name}-{i}": (p, params) for name, params in settings.items()
                for i, p in enumerate(PROMPTS[:3])}  # fmt: skip
    markov_dir, oracle, _ = markov
    eagle3 = build_random_draft(target[0], tmp_path / "eagle3", "eagle3")
    for model_dir, draft in [(markov_dir, oracle), (target[0], eagle3)]:
        base = run(engine_for(model_dir), requests)
        engine = engine_for(model_dir, SpeculativeConfig(str(draft), num_draft_tokens=4))
        out = run(engine, requests)
        assert {r: o.token_ids for r, o in out.items()} == {r: o.token_ids for r, o in base.items()}
        assert_counts_add_up(engine, out)
        if draft == oracle:
            stats = engine.spec.stats  # type: ignore[union-attr]
            assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
            for name in settings:
                if name != "plain":  # the penalty changes what the oracle's target emits
                    assert base[f"{name}-0"].token_ids != base["plain-0"].token_ids, name
                    counts = out[f"{name}-0"].spec_counts
                    assert counts is not None and counts.num_accepted_tokens > 0, name

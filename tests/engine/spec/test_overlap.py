"""Overlap scheduling (engine.spec.overlap) on the graph runner's CPU path: the same tokens
as without it, greedy and seeded sampled rows, every drafter, requests arriving and ending
at different steps, stop tokens, stop strings, EOS and max_tokens; every block free after,
no token past a stop; rows it does not cover run as without it; what it refuses."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.block_manager import BlockManager
from engine.llm_engine import EngineConfig, LLMEngine, RequestOutput
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence, SequenceStatus
from engine.spec.adaptive import AdaptiveK, StepCost
from engine.spec.config import SpeculativeConfig
from engine.spec.overlap import AheadStep, reserve
from tests.engine.spec.test_spec_greedy import PROMPTS, markov_target
from tests.engine.tiny_drafts import build_random_draft
from tests.engine.tiny_models import build_tiny_llama
from tests.services.tiny_tokenizer import save_char_tokenizer

MAX_LEN = 64
Requests = dict[str, tuple[list[int], SamplingParams]]


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


def sampled(n: int, seed: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=kw.pop("temperature", 0.9), seed=seed, **kw)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny products run fastest on one thread: two wait on each other on a busy machine
    (a run of these tests took 14x longer at torch's default of 2)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory):
    """The spec tests' tiny target with a character tokenizer (ids 3..63 are characters,
    2 is EOS), so that stop strings are detected as they are served."""
    out = tmp_path_factory.mktemp("overlap_target")
    build_tiny_llama(out, "gqa3_llama3rope_tied_bias_hd40", num_layers=3, vocab_size=64)
    tokenizer = save_char_tokenizer(out)
    return out, tokenizer, stop_requests(out, tokenizer)


@pytest.fixture(scope="module")
def markov(tmp_path_factory: pytest.TempPathFactory):
    """A target whose EAGLE draft is exact: rows accept all K drafts (sampled rows some)."""
    target_dir, draft_dir, _ = markov_target(tmp_path_factory.mktemp("overlap_markov"))
    return target_dir, draft_dir, save_char_tokenizer(target_dir)


def engine_for(model_dir: Path, tokenizer, spec: SpeculativeConfig, **kw) -> LLMEngine:
    cfg = dict(
        model=str(model_dir),
        dtype="float32",
        kv_cache_memory=1 << 21,
        block_size=4,
        max_model_len=MAX_LEN,
        max_num_seqs=8,
        cuda_graphs=True,  # the graph runner's path, uncaptured on CPU
        cpu_gemm="aten",  # plain products: prepacking tiny weights costs more
    )
    cfg.update(kw)
    return LLMEngine(EngineConfig(**cfg, speculative=spec), tokenizer=tokenizer)  # type: ignore[arg-type]


def run(engine: LLMEngine, requests: Requests, abort: tuple[str, int] | None = None):
    """Request i arrives at step i, so that the batch changes size every step; ``abort``:
    (request id, step) aborts it there. Every block is free at the end."""
    pending = list(requests.items())
    done: dict[str, RequestOutput] = {}
    steps = 0
    while pending or engine.has_unfinished_requests():
        if pending:
            rid, (prompt, params) = pending.pop(0)
            engine.add_request(rid, prompt, params)
        if abort is not None and steps == abort[1]:
            engine.drop_request(abort[0])
        for out in engine.step():
            assert out.request_id not in done, out.request_id  # nothing after the end
            if out.finished:
                done[out.request_id] = out
        steps += 1
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert not engine.scheduler.running and not engine.scheduler.waiting
    return done


def stop_requests(model_dir: Path, tokenizer) -> Requests:
    """Greedy and sampled rows of many lengths; stop tokens and strings taken from
    target-only greedy output, so that they are met inside a step's accepted tokens."""
    ref = LLMEngine(
        EngineConfig(
            model=str(model_dir),
            dtype="float32",
            block_size=4,
            max_model_len=MAX_LEN,
            cpu_gemm="aten",
        ),
        tokenizer=tokenizer,
    )
    base = {str(i): out.token_ids for i, out in enumerate(run_plain(ref, [PROMPTS[1], PROMPTS[2]]))}
    stop_token = base["0"][9]
    text = tokenizer.decode(base["1"], skip_special_tokens=True)
    stop_text = text[len(text) // 2 :][:2]
    return {
        "greedy": (PROMPTS[0], greedy(17)),
        "stop_token": (PROMPTS[1], greedy(20, stop_token_ids=[stop_token])),
        "stop_string": (PROMPTS[2], greedy(20, stop=[stop_text])),
        "sampled": (PROMPTS[3], sampled(13, seed=3)),
        "sampled_eos": (PROMPTS[4], sampled(18, seed=4, temperature=1.0, top_k=8)),
        "one_token": (PROMPTS[5], greedy(1)),
        "short": (PROMPTS[0], greedy(5)),
        "sampled_stop": (
            PROMPTS[1],
            sampled(20, seed=7, top_p=0.9, stop_token_ids=[stop_token], stop=[stop_text]),
        ),
        "long": (PROMPTS[2], sampled(26, seed=9, min_p=0.05, ignore_eos=True)),
    }


def run_plain(engine: LLMEngine, prompts: list[list[int]]) -> list[RequestOutput]:
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, greedy(16))
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    return [done[str(i)] for i in range(len(prompts))]


def assert_same(
    engine_kw: dict, requests: Requests, tokenizer, **run_kw
) -> tuple[LLMEngine, dict[str, RequestOutput]]:
    """Runs ``requests`` without overlap and with it: the same tokens, ends and speculative
    counters; no token past a stop. Returns the engine that overlapped and its outputs."""
    outs, engines = [], []
    for overlap in (False, True):
        engine = engine_for(**engine_kw, tokenizer=tokenizer, enable_overlap_scheduler=overlap)
        outs.append(run(engine, requests, **run_kw))
        engines.append(engine)
    sync, ahead = outs
    assert sync.keys() == ahead.keys()
    for rid, want in sync.items():
        got = ahead[rid]
        assert got.token_ids == want.token_ids, rid
        assert (got.finish_reason, got.stop_reason, got.text) == (
            want.finish_reason,
            want.stop_reason,
            want.text,
        ), rid
        assert got.spec_counts == want.spec_counts, rid
        if rid in requests:
            params = requests[rid][1]
            assert_no_token_past_a_stop(got, params, engines[1].eos_token_ids, tokenizer)
    for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        assert getattr(engines[0].spec.stats, name) == getattr(engines[1].spec.stats, name)
    assert engines[0].num_steps_ahead == 0 and engines[1].num_steps_ahead > 0
    return engines[1], ahead


def assert_no_token_past_a_stop(
    out: RequestOutput, params: SamplingParams, eos: frozenset[int], tokenizer
) -> None:
    tokens = out.token_ids
    assert 1 <= len(tokens) <= params.max_tokens
    if out.finish_reason == "length":
        assert len(tokens) == params.max_tokens
    ends = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos))
    assert not ends & set(tokens[:-1])  # a stop token or EOS ends the output at once
    if out.finish_reason == "stop" and isinstance(out.stop_reason, int):
        assert tokens[-1] == out.stop_reason
    for stop in params.stop:
        assert stop not in tokenizer.decode(tokens[:-1])
    if isinstance(out.stop_reason, str):
        assert out.stop_reason in tokenizer.decode(tokens)


@pytest.mark.parametrize("kind", ["eagle", "eagle3", "dflash"])
def test_overlap_gives_the_same_tokens_for_every_drafter(target, tmp_path, kind):
    model_dir, tokenizer, requests = target
    extra = {"draft_vocab_size": 32} if kind == "eagle3" else {}
    d2t = torch.arange(32) if kind == "eagle3" else None
    draft = build_random_draft(model_dir, tmp_path / kind, kind, std=0.2, d2t=d2t, **extra)
    spec = SpeculativeConfig(str(draft), num_draft_tokens=3)
    engine, out = assert_same(dict(model_dir=model_dir, spec=spec), requests, tokenizer)
    assert engine.spec is not None and engine.spec.stats.num_draft_tokens > 0
    assert_stops_were_met(out, requests)


def assert_stops_were_met(out: dict[str, RequestOutput], requests: Requests) -> None:
    """The greedy rows' stop token and stop string come from their own output: met."""
    assert out["stop_token"].stop_reason == requests["stop_token"][1].stop_token_ids[0]
    assert out["stop_string"].stop_reason == requests["stop_string"][1].stop[0]
    assert out["one_token"].token_ids and out["short"].finish_reason == "length"


def test_overlap_with_drafts_that_are_all_accepted(markov):
    """K+1 tokens per step: the worst case that blocks are reserved for, and stops that
    fall inside a block of accepted drafts; sampled rows accept some."""
    target_dir, draft_dir, tokenizer = markov
    requests = stop_requests(target_dir, tokenizer)
    spec = SpeculativeConfig(str(draft_dir), num_draft_tokens=4)
    engine, out = assert_same(dict(model_dir=target_dir, spec=spec), requests, tokenizer)
    assert engine.spec is not None
    assert_stops_were_met(out, requests)
    stats = engine.spec.stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens


def test_rows_it_does_not_cover_run_without_it(markov):
    """A row with logprobs and one with penalties make the engine read the step in flight
    and run as without overlap while they run; overlap resumes after them."""
    target_dir, draft_dir, tokenizer = markov
    requests: Requests = {
        "a": (PROMPTS[0], greedy(30)),
        "b": (PROMPTS[3], sampled(30, seed=1, ignore_eos=True)),
        "logprobs": (PROMPTS[1], greedy(6, logprobs=2)),
        "penalty": (PROMPTS[2], sampled(6, seed=2, repetition_penalty=1.3, ignore_eos=True)),
        **{f"late{i}": (PROMPTS[4], greedy(12 + i)) for i in range(3)},
    }
    spec = SpeculativeConfig(str(draft_dir), num_draft_tokens=3)
    engine, _ = assert_same(dict(model_dir=target_dir, spec=spec), requests, tokenizer)
    assert engine.num_steps_ahead >= 5


def adaptive_run(
    engine: LLMEngine, requests: Requests, costs: dict[int, StepCost], probe_budget: float
) -> dict[str, RequestOutput]:
    """``requests`` on ``engine`` with injected costs at every batch bucket, in place of
    the measured ones: no timing decides K."""
    assert engine.spec is not None and engine.spec.adaptive is not None
    buckets = engine.spec.adaptive.buckets
    engine.spec.adaptive = AdaptiveK(
        range(4), dict.fromkeys(buckets, costs), probe_budget=probe_budget
    )
    return run(engine, requests)


def test_adaptive_k_is_chosen_for_each_step_launched_ahead(markov):
    """With the prior's acceptance (1/2) K = 1 pays best under these costs; the exact
    draft's rows accept everything, and K = 3 comes to pay once probes have seen it. The
    steps launched ahead verify what the step before proposed, 1 and then 3, and greedy
    output is the target's."""
    target_dir, draft_dir, tokenizer = markov
    requests: Requests = {str(i): (p, greedy(30 + i)) for i, p in enumerate(PROMPTS[:4])}
    plain = LLMEngine(
        EngineConfig(model=str(target_dir), dtype="float32", block_size=4, cpu_gemm="aten"),
        tokenizer=tokenizer,
    )
    base = run(plain, requests)
    spec = SpeculativeConfig(str(draft_dir), num_draft_tokens=3, adaptive=True)
    engine = engine_for(target_dir, tokenizer, spec, enable_overlap_scheduler=True)
    costs = {0: StepCost(1.0), 1: StepCost(1.2), 2: StepCost(1.6), 3: StepCost(1.9)}
    out = adaptive_run(engine, requests, costs, probe_budget=0.3)  # a probe every few steps
    assert {r: o.token_ids for r, o in out.items()} == {r: o.token_ids for r, o in base.items()}
    assert engine.spec is not None and engine.num_steps_ahead >= 10
    steps = engine.spec.stats.steps_per_k
    assert steps[1] > 0 and steps[3] > steps[1]
    assert engine.spec.adaptive is not None and engine.spec.adaptive.alphas()[2] > 0.9


def test_adaptive_k_launches_plain_steps_ahead_where_drafts_never_pay(markov):
    target_dir, draft_dir, tokenizer = markov
    requests: Requests = {str(i): (p, greedy(20)) for i, p in enumerate(PROMPTS[:3])}
    spec = SpeculativeConfig(str(draft_dir), num_draft_tokens=3, adaptive=True)
    engine = engine_for(target_dir, tokenizer, spec, enable_overlap_scheduler=True)
    dear = {0: StepCost(1.0), 1: StepCost(3.0), 2: StepCost(4.0), 3: StepCost(5.0)}
    out = adaptive_run(engine, requests, dear, probe_budget=0.0)
    assert all(len(o.token_ids) == 20 for o in out.values())
    assert engine.spec is not None and engine.num_steps_ahead >= 10
    assert engine.spec.stats.num_draft_tokens == 0 and len(engine.spec.stats.steps_per_k) == 1


def test_an_abort_in_flight_frees_its_blocks_after_the_step(markov):
    target_dir, draft_dir, tokenizer = markov
    requests: Requests = {str(i): (p, greedy(30)) for i, p in enumerate(PROMPTS[:4])}
    spec = SpeculativeConfig(str(draft_dir), num_draft_tokens=3)
    engine = engine_for(target_dir, tokenizer, spec, enable_overlap_scheduler=True)
    out = run(engine, requests, abort=("1", 6))  # run() checks every block is free
    assert "1" not in out and all(len(out[r].token_ids) == 30 for r in ("0", "2", "3"))


def running_row(blocks: BlockManager, num_computed: int, max_tokens: int = 50) -> Sequence:
    """A decoding row of one prompt token: KV for ``num_computed`` tokens, one pending."""
    s = Sequence("r", [1] * (num_computed + 1), 1, greedy(max_tokens), seed=0)
    blocks.allocate(s)
    s.status, s.num_computed_tokens = SequenceStatus.RUNNING, num_computed
    return s


def test_reserve_grows_for_the_worst_case_or_reserves_nothing():
    """K=3, 2 lookahead slots, blocks of 4: a row of the step in flight that continues needs
    slots up to n + K + 2 + 2; one that may reach max_tokens there does not continue."""
    blocks = BlockManager(8, 4, enable_prefix_caching=False, num_lookahead_slots=2)
    a = running_row(blocks, 5)  # 6 tokens + 2 slots: 2 blocks
    near_end = running_row(blocks, 5, max_tokens=8)  # 5 output tokens + K + 1 >= 8
    fresh = running_row(blocks, 1)  # not in the step in flight: 1 block
    step = AheadStep([a, near_end], 3, 3, torch.zeros(2), pending=None)  # type: ignore[arg-type]
    assert blocks.num_free_blocks == 3
    assert reserve(blocks, [a, near_end, fresh], step)
    assert step.continuing == [a] and len(a.block_table) == 3  # 5 + 5 + 2 = 12 slots
    assert len(near_end.block_table) == 2 and len(fresh.block_table) == 1
    assert step.may_launch(a) and step.may_launch(fresh) and not step.may_launch(near_end)
    # The free blocks do not hold both continuing rows' worst case: nothing is reserved.
    b = running_row(blocks, 5)  # 2 blocks: none free after
    tight = AheadStep([a, b], 3, 3, torch.zeros(2), pending=None)  # type: ignore[arg-type]
    assert blocks.num_free_blocks == 0
    assert not reserve(blocks, [a, b, near_end, fresh], tight)
    assert len(b.block_table) == 2 and tight.continuing == []


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(speculative=None), "needs speculative decoding"),
        (dict(cuda_graphs=False), "the graph runner"),
        (dict(cuda_graphs=None), "True on CPU"),
        (dict(sample_drafts=True), "sampled drafts"),
    ],
)
def test_config_refuses_what_it_does_not_cover(change, message):
    spec_kw = {k: change.pop(k) for k in ("sample_drafts",) if k in change}
    kw = dict(model="m", cuda_graphs=True, speculative=SpeculativeConfig("draft", **spec_kw))
    kw.update(change)
    with pytest.raises(ValueError, match=f"^enable_overlap_scheduler: .*{message}"):
        EngineConfig(**kw, enable_overlap_scheduler=True)  # type: ignore[arg-type]
    EngineConfig(**kw)  # type: ignore[arg-type]  # valid without it

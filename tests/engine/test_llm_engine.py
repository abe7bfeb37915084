"""Engine behaviour on a tiny random model: stopping, refusal, seeds, logprobs, prefix reuse."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from engine.kv_cache import KVCacheCapacityError
from engine.llm_engine import EngineConfig, LLMEngine, RequestError, RequestOutput
from engine.sampling_params import SamplingParams
from tests.engine.tiny_models import build_tiny_llama


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):
    out = tmp_path_factory.mktemp("tiny")
    model = build_tiny_llama(out, "gqa3_llama3rope_tied_bias_hd40", num_layers=2, vocab_size=64)
    return out, model


def engine_for(model_dir, **kwargs) -> LLMEngine:
    cfg = dict(model=str(model_dir), dtype="float32", kv_cache_memory=1 << 21, block_size=4)
    cfg.update(kwargs)
    return LLMEngine(EngineConfig(**cfg))


def run(
    engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]
) -> dict[str, RequestOutput]:
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


def test_start_up_objects_leave_the_collector_and_go_with_the_engine(tiny):
    """What loading (and compiling) made is frozen out of the cyclic collector, whose full
    passes over a compiled engine's million objects stalled decode steps for a second;
    reference counts still free the engine, its KV cache included, when it goes."""
    model_dir, _ = tiny
    gc.unfreeze()
    engine = engine_for(model_dir)
    assert gc.get_freeze_count() > 0
    assert run(engine, {"a": ([1, 2, 3], greedy(4))})["a"].finish_reason == "length"
    kv_pool = weakref.ref(engine.runner.kv_cache.layers[0][0])
    del engine
    assert kv_pool() is None


def test_stop_token_ids_and_eos(tiny):
    model_dir, _ = tiny
    base = run(engine_for(model_dir), {"a": ([5, 6, 7], greedy(12))})["a"].token_ids
    stop = base[4]
    first = base.index(stop)
    out = run(engine_for(model_dir), {"a": ([5, 6, 7], greedy(12, stop_token_ids=[stop]))})["a"]
    assert out.token_ids == base[: first + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    # EOS (id 2 in the tiny config) ends a request unless ignore_eos is set.
    engine = engine_for(model_dir)
    engine.stops.eos_token_ids = frozenset({stop})
    out = run(engine, {"a": ([5, 6, 7], SamplingParams(max_tokens=12, temperature=0.0))})["a"]
    assert out.token_ids == base[: first + 1] and out.finish_reason == "stop"


def test_max_tokens_and_length_finish(tiny):
    model_dir, _ = tiny
    outs = run(engine_for(model_dir), {str(n): ([9, 8, 7], greedy(n)) for n in (1, 2, 5, 17)})
    for n in (1, 2, 5, 17):
        assert len(outs[str(n)].token_ids) == n
        assert outs[str(n)].finish_reason == "length"
    assert outs["17"].token_ids[:5] == outs["5"].token_ids


def test_refusals_name_the_problem(tiny):
    model_dir, _ = tiny
    engine = engine_for(model_dir, max_model_len=64)
    with pytest.raises(RequestError, match=r"^prompt: is empty"):
        engine.add_request("a", [], greedy(4))
    with pytest.raises(
        RequestError, match=r"^prompt: token id 64 is outside the vocabulary \[0, 64\)"
    ):
        engine.add_request("a", [1, 64], greedy(4))
    with pytest.raises(RequestError, match=r"^stop_token_ids: token id 99"):
        engine.add_request("a", [1], greedy(4, stop_token_ids=[99]))
    with pytest.raises(
        RequestError, match=r"^max_tokens: prompt \(10 tokens\) \+ max_tokens \(60\) = 70"
    ):
        engine.add_request("a", [1] * 10, greedy(60))
    with pytest.raises(RequestError, match=r"^stop: stop strings need a tokenizer"):
        engine.add_request("a", [1], greedy(4, stop=["x"]))
    engine.add_request("a", [1], greedy(4))
    with pytest.raises(RequestError, match=r"^request_id: 'a' is already running"):
        engine.add_request("a", [1], greedy(4))
    small = engine_for(
        model_dir, kv_cache_memory=4 * 2 * 2 * 4 * 2 * 40 * 4
    )  # 4 blocks of 4 tokens
    assert small.block_manager.num_blocks == 4
    with pytest.raises(KVCacheCapacityError, match="needs 5 blocks but the cache has only 4"):
        small.add_request("b", [1] * 10, greedy(10))


def test_seeded_sampling_is_independent_of_batch_and_chunking(tiny):
    model_dir, _ = tiny
    params = SamplingParams(max_tokens=16, temperature=0.9, top_k=20, top_p=0.95, seed=1234)
    alone = run(engine_for(model_dir), {"x": ([3, 4, 5, 6, 7], params)})["x"].token_ids
    crowd = {
        f"o{i}": ([10 + i] * (i + 2), SamplingParams(max_tokens=9, temperature=1.0, seed=i))
        for i in range(5)
    }
    crowd["x"] = ([3, 4, 5, 6, 7], params)
    batched = run(engine_for(model_dir, max_num_batched_tokens=3), crowd)["x"].token_ids
    assert batched == alone
    other_seed = SamplingParams(max_tokens=16, temperature=0.9, top_k=20, top_p=0.95, seed=1235)
    assert run(engine_for(model_dir), {"x": ([3, 4, 5, 6, 7], other_seed)})["x"].token_ids != alone


def test_mixed_greedy_and_sampled_rows(tiny):
    model_dir, _ = tiny
    ref = run(engine_for(model_dir), {"g": ([7, 7, 8], greedy(10))})["g"].token_ids
    outs = run(
        engine_for(model_dir),
        {
            "g": ([7, 7, 8], greedy(10)),
            "s": ([7, 7, 8], SamplingParams(max_tokens=10, temperature=1.5, seed=3)),
        },
    )
    assert outs["g"].token_ids == ref
    assert outs["s"].token_ids != ref


def test_logprobs_are_the_model_distribution(tiny):
    model_dir, hf = tiny
    prompt = [4, 9, 16, 25]
    out = run(engine_for(model_dir), {"a": (prompt, greedy(3, logprobs=5))})["a"]
    assert len(out.logprobs) == 3
    with torch.inference_mode():
        ids = torch.tensor([prompt + out.token_ids])
        ref = torch.log_softmax(hf(ids, attention_mask=torch.ones_like(ids)).logits[0].float(), -1)
    for i, lp in enumerate(out.logprobs):
        row = ref[len(prompt) - 1 + i]
        assert lp.token_id == out.token_ids[i]
        assert abs(lp.logprob - row[lp.token_id].item()) < 1e-4
        top = row.topk(5)
        assert list(lp.top) == top.indices.tolist()
        assert (
            max(abs(a - b) for a, b in zip(lp.top.values(), top.values.tolist(), strict=True))
            < 1e-4
        )


def test_prefix_cache_reuse_gives_identical_output(tiny):
    model_dir, _ = tiny
    engine = engine_for(model_dir)
    prompt = list(range(3, 30))
    first = run(engine, {"a": (prompt, greedy(8))})["a"]
    second = run(engine, {"b": (prompt, greedy(8))})["b"]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 24  # 6 full blocks of 4; the last token is recomputed
    assert second.token_ids == first.token_ids
    assert engine.block_manager.num_prefix_hit_blocks == 6


def test_preemption_by_recompute_keeps_output_identical(tiny):
    model_dir, _ = tiny
    prompts = {f"r{i}": ([3 + i, 5, 7, 11, 13][: 2 + i], greedy(14)) for i in range(4)}
    roomy = run(engine_for(model_dir), dict(prompts))
    tight_engine = engine_for(
        model_dir, kv_cache_memory=9 * 2 * 2 * 4 * 2 * 40 * 4, enable_prefix_caching=False
    )
    assert tight_engine.block_manager.num_blocks == 9
    tight = run(tight_engine, dict(prompts))
    assert tight_engine.scheduler.num_preemptions > 0
    for rid in prompts:
        assert tight[rid].token_ids == roomy[rid].token_ids


def test_the_allocator_counts_each_request_holding_a_shared_cached_prefix(tiny) -> None:
    """What an audit compares with the ledger (``owned_block_ids``): a second request whose
    prompt begins with a running one's holds the three cached full blocks of that prefix
    too, and the allocator counts 2 holders for each of them and 1 for every other block."""
    from engine.engine_figures import block_tables, owned_block_ids

    model_dir, _ = tiny
    engine = engine_for(model_dir)
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]  # 3 full blocks of 4
    engine.add_request("a", prompt, greedy(6))
    engine.step()  # a's prompt: its full blocks are hashed, and cached
    engine.add_request("b", [*prompt, 17, 18], greedy(6))
    engine.step()
    tables = block_tables(engine, ["a", "b"])
    shared = set(tables["a"]) & set(tables["b"])
    assert tables["a"][:3] == tables["b"][:3] and shared == set(tables["a"][:3])
    found = owned_block_ids(engine)
    counts = dict(zip(found.owned, found.ref_counts, strict=True))
    assert set(counts) == set(tables["a"]) | set(tables["b"])
    assert {b: n for b, n in counts.items() if n > 1} == dict.fromkeys(shared, 2)

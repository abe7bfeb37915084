"""The engine's disaggregation seam: a prefill-only engine computes the prompt and first
token (and drafts), its KV blocks are copied into blocks a second engine reserved, and the
second engine decodes: the output equals one engine doing everything."""

from __future__ import annotations

import pytest

from engine.kv_cache import KVCacheCapacityError
from engine.llm_engine import EngineConfig, LLMEngine, RequestError
from engine.output_processor import OutputProcessor
from engine.outputs import RequestDelta
from engine.sampling_params import SamplingParams
from engine.spec.config import SpeculativeConfig
from tests.engine.tiny_drafts import build_random_draft
from tests.engine.tiny_models import build_tiny_llama

PROMPTS = [[5, 6, 7], [9] * 11, [3, 4, 8, 8, 1], [10, 11, 12, 13, 14, 15, 16]]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    out = tmp_path_factory.mktemp("disagg")
    build_tiny_llama(out / "target", "gqa4_llama3rope_hd72_mlpbias", num_layers=2, vocab_size=64)
    build_random_draft(out / "target", out / "eagle3", "eagle3")
    return out / "target", out / "eagle3"


def engine(target, draft=None, **kw) -> LLMEngine:
    spec = None if draft is None else SpeculativeConfig(str(draft), num_draft_tokens=3)
    cfg = dict(model=str(target), dtype="float32", block_size=4, kv_cache_memory=1 << 21)
    cfg.update(kw)
    return LLMEngine(EngineConfig(**cfg, speculative=spec))


# Both workers apply them: the prefill worker to the first token (repetition over the
# prompt, the rest over an empty output), the decode worker to the rest.
PENALTIES = dict(
    frequency_penalty=0.7, presence_penalty=0.4, repetition_penalty=1.5, logit_bias={9: -50.0}
)


def params(i: int, penalized: bool = False) -> SamplingParams:
    extra = PENALTIES if penalized else {}
    if i % 2:
        return SamplingParams(
            max_tokens=15, temperature=0.9, seed=100 + i, ignore_eos=True, **extra
        )
    return SamplingParams(max_tokens=15, temperature=0.0, ignore_eos=True, **extra)


def drain(e: LLMEngine, firsts: list[RequestDelta] | None = None) -> dict[str, list[int]]:
    """Each request's output once it ended; ``firsts``: the first deltas of requests that
    ``start_decoding`` joined (their outputs are assembled from them on, as a decode
    worker does; ``step`` assembles those of requests it saw added)."""
    outputs = OutputProcessor(e.tokenizer)
    outputs.process(firsts or [])
    done = {}
    while e.has_unfinished_requests():
        for out in outputs.process(e.step_deltas()) if firsts else e.step():
            if out.finished:
                done[out.request_id] = out.token_ids
    return done


@pytest.mark.parametrize(
    ("with_draft", "penalized"),
    [(False, False), (True, False), (True, True)],
    ids=["target", "draft", "draft_penalized"],
)
def test_prefill_here_decode_there_equals_one_engine(dirs, with_draft, penalized):
    target, draft = dirs
    draft = draft if with_draft else None
    whole = engine(target, draft)
    for i, p in enumerate(PROMPTS):
        whole.add_request(str(i), p, params(i, penalized))
    expected = drain(whole)
    if penalized:  # not what the same requests give without them
        plain = engine(target, draft)
        for i, p in enumerate(PROMPTS):
            plain.add_request(str(i), p, params(i))
        assert drain(plain) != expected

    prefill, decode = engine(target, draft), engine(target, draft)
    for i, p in enumerate(PROMPTS):
        prefill.add_request(str(i), p, params(i, penalized), is_prefill_only=True)
    while prefill.has_unfinished_requests():
        prefill.step()
    firsts = []
    for i, p in enumerate(PROMPTS):
        rid = str(i)
        done = prefill.take_prefilled(rid)
        assert done is not None and len(done.draft_token_ids) == (3 if with_draft else 0)
        table, num_cached = decode.reserve(rid, p, params(i, penalized))
        assert num_cached == 0 and len(table) == len(done.block_table)
        for name, pool in prefill.kv_pools.items():  # what a KV transport does
            dst = decode.kv_pools[name]
            for (k_src, v_src), (k_dst, v_dst) in zip(pool.layers, dst.layers, strict=True):
                k_dst[table] = k_src[done.block_table]
                v_dst[table] = v_src[done.block_table]
        prefill.drop_request(rid)
        first = decode.start_decoding(rid, done.first_token, done.draft_token_ids)
        assert first.new_token_ids == [done.first_token] and first.start is not None
        firsts.append(first)
    assert prefill.block_manager.num_free_blocks == prefill.block_manager.num_blocks
    assert drain(decode, firsts) == expected
    assert decode.block_manager.num_free_blocks == decode.block_manager.num_blocks


def test_reserve_refuses_when_full_and_abort_frees(dirs):
    target, _ = dirs
    e = engine(target, kv_cache_memory=12 * 4 * 2 * 2 * 2 * 72 * 4)  # 12 blocks
    assert e.block_manager.num_blocks == 12
    table, _ = e.reserve("a", list(range(1, 40)), SamplingParams(max_tokens=4))
    assert len(table) == 10
    with pytest.raises(KVCacheCapacityError, match="retry later"):
        e.reserve("b", list(range(1, 20)), SamplingParams(max_tokens=4))
    e.drop_request("a")
    assert e.block_manager.num_free_blocks == 12
    with pytest.raises(RequestError, match="not reserved"):
        e.start_decoding("a", 5)


def test_preempted_requests_hand_back_and_resume_where_they_stopped(dirs):
    """A decode engine short of blocks ends the newest request with "preempted" (blocks
    freed, the tokens so far in its output); resuming it elsewhere from prompt + those
    tokens gives exactly what one roomy engine gives, greedy and seeded rows alike."""
    target, _ = dirs
    whole = engine(target)
    for i, p in enumerate(PROMPTS):
        whole.add_request(str(i), p, params(i))
    expected = drain(whole)

    block_bytes = (1 << 21) // whole.block_manager.num_blocks
    tight = engine(target, preemption="hand_back", kv_cache_memory=14 * block_bytes)
    assert tight.block_manager.num_blocks == 14  # 4 requests need up to 7 blocks each
    for i, p in enumerate(PROMPTS):
        tight.add_request(str(i), p, params(i))
    done: dict[str, list[int]] = {}
    handed_back = []
    while tight.has_unfinished_requests():
        for out in tight.step():
            if out.finish_reason == "preempted":
                handed_back.append(out.request_id)
                assert out.finished and 0 < len(out.token_ids) < 15
                assert out.request_id not in tight._seqs  # gone here, nothing held
                resumed = engine(target)
                p = PROMPTS[int(out.request_id)]
                resumed.add_request(
                    out.request_id,
                    p + out.token_ids,
                    params(int(out.request_id)),
                    num_output_tokens_sent=len(out.token_ids),
                )
                done.update(drain(resumed))
            elif out.finished:
                done[out.request_id] = out.token_ids
    assert handed_back, "the cache was meant to run out"
    assert tight.scheduler.num_preemptions == len(handed_back)
    assert done == expected
    assert tight.block_manager.num_free_blocks == tight.block_manager.num_blocks


def test_resume_is_validated(dirs):
    target, _ = dirs
    e = engine(target)
    with pytest.raises(RequestError, match="num_output_tokens_sent"):
        e.add_request("a", [5, 6], SamplingParams(max_tokens=3), num_output_tokens_sent=3)
    with pytest.raises(RequestError, match="num_output_tokens_sent"):
        e.add_request("b", [5, 6, 7, 8], SamplingParams(max_tokens=3), num_output_tokens_sent=3)
    with pytest.raises(ValueError, match="preemption"):
        EngineConfig(model=str(target), preemption="drop")


@pytest.mark.parametrize("with_draft", [False, True], ids=["target", "draft"])
def test_reserved_then_prefilled_in_place_equals_one_engine(dirs, with_draft):
    """Co-located: a reserved request whose prompt this engine computes into its reserved
    blocks (``prefill_reserved``), joining a batch already decoding, is PREFILLED after
    its first token with the reservation's blocks, and ``start_decoding`` decodes it on in
    place: what one engine doing everything gives, greedy and seeded rows, prefix-cached
    blocks included."""
    target, draft = dirs
    draft = draft if with_draft else None
    prompts = [*PROMPTS, PROMPTS[1] + [2, 3]]  # the last shares 2 blocks with prompt 1
    whole = engine(target, draft)
    for i, p in enumerate(prompts):
        whole.add_request(str(i), p, params(i))
    expected = drain(whole)

    here = engine(target, draft)
    outputs = OutputProcessor(None)
    done: dict[str, list[int]] = {}
    tables: dict[str, list[int]] = {}

    def step() -> set[str]:
        deltas = here.step_deltas()
        done.update({o.request_id: o.token_ids for o in outputs.process(deltas) if o.finished})
        return {d.request_id for d in deltas}

    def decode_when_prefilled(pending: set[str]) -> None:
        while here.has_unfinished_requests() or pending:
            for rid in sorted(pending):
                if (prefilled := here.take_prefilled(rid)) is not None:
                    assert prefilled.block_table == tables[rid]  # the reservation's blocks
                    first = here.start_decoding(
                        rid, prefilled.first_token, prefilled.draft_token_ids
                    )
                    assert first.start is not None and first.new_token_ids == [
                        prefilled.first_token
                    ]
                    outputs.process([first])  # the decode side's outputs start here
                    pending.discard(rid)
            step()

    here.add_request("0", prompts[0], params(0))
    step()  # decoding when the others join
    for i in (1, 2, 3):
        tables[str(i)], num_cached = here.reserve(str(i), prompts[i], params(i))
        assert num_cached == 0
        assert str(i) not in step()  # reserved: not computed
        here.prefill_reserved(str(i), prompts[i])
    with pytest.raises(RequestError, match="not reserved"):
        here.prefill_reserved("0", prompts[0])
    decode_when_prefilled({"1", "2", "3"})
    tables["4"], num_cached = here.reserve("4", prompts[4], params(4))
    assert num_cached == 8  # prompt 1's blocks, cached
    with pytest.raises(RequestError, match="prompt_token_ids: not the 13 ids reserved"):
        here.prefill_reserved("4", prompts[1])
    here.prefill_reserved("4", prompts[4])
    decode_when_prefilled({"4"})
    assert done == expected
    assert here.block_manager.num_free_blocks == here.block_manager.num_blocks


def test_blocks_of_a_request_ended_by_its_first_token_are_not_cached(dirs):
    """A prefill worker pushes no KV (or only part) for a request that its first token
    ends, here one resumed at max_tokens - 1: the decode worker's blocks for it do not hold
    its KV, so they must not enter the prefix cache. Cached, they would give the next
    request with that prompt a prefix hit (its push skipping those blocks) and decode it
    from KV that is not its own."""
    target, draft = dirs
    prompt, p = PROMPTS[1], params(0)  # 11 tokens: 2 full blocks, greedy, 15 tokens
    whole = engine(target, draft)
    whole.add_request("w", prompt, p)
    expected = drain(whole)["w"]

    decode, prefill = engine(target, draft), engine(target, draft)
    resumed = prompt + expected[:-1]
    assert decode.reserve("r", resumed, p, len(expected) - 1)[1] == 0
    ended = decode.start_decoding("r", expected[-1])  # KV never pushed: blocks unwritten
    (output,) = OutputProcessor(None).process([ended])
    assert output.finish_reason == "length" and output.token_ids == expected
    assert decode.block_manager.num_free_blocks == decode.block_manager.num_blocks

    table, num_cached = decode.reserve("s", prompt, p)
    assert num_cached == 0
    prefill.add_request("s", prompt, p, is_prefill_only=True)
    while prefill.has_unfinished_requests():
        prefill.step()
    done = prefill.take_prefilled("s")
    assert done is not None
    for name, pool in prefill.kv_pools.items():  # what the push sends: the uncached blocks
        dst = decode.kv_pools[name]
        for (k_src, v_src), (k_dst, v_dst) in zip(pool.layers, dst.layers, strict=True):
            k_dst[table] = k_src[done.block_table]
            v_dst[table] = v_src[done.block_table]
    prefill.drop_request("s")
    first = decode.start_decoding("s", done.first_token, done.draft_token_ids)
    assert drain(decode, [first]) == {"s": expected}


def test_a_first_token_that_ended_the_request_on_prefill_ends_it_here(dirs):
    """``has_kv`` False (the prefill worker's first token ended the request, so it pushed
    no KV): the request ends here whatever the token, nothing cached or held. A token
    that the engine's checks do not end it on says so (its delta is not finished): only a
    stop string, in the text, may have ended it, and the decode worker refuses it if none
    did (tests/decode_worker/test_first_token_sent.py)."""
    target, _ = dirs
    decode = engine(target)
    decode.reserve("a", PROMPTS[1], params(0))
    delta = decode.start_decoding("a", 5, has_kv=False)
    assert delta.new_token_ids == [5] and not delta.finished
    assert not decode.has_unfinished_requests()
    assert decode.block_manager.num_free_blocks == decode.block_manager.num_blocks
    assert decode.reserve("b", PROMPTS[1], params(0))[1] == 0

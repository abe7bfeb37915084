"""The engine hands out deltas (``step_deltas``): the tokens and logprobs each step added to
a request, its start on the first. They add up to what the offline ``step`` assembles, and
the engine's thread never decodes text: stop strings are found where the deltas are
assembled, and the request, still running in the engine, is dropped a step later with the
same output as when the engine is stepped offline."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from engine.llm_engine import EngineConfig, LLMEngine
from engine.output_processor import OutputProcessor
from engine.outputs import RequestDelta, RequestOutput
from engine.sampling_params import SamplingParams
from engine.sequence import FinishReason
from tests.engine.tiny_models import build_tiny_llama
from tests.services.tiny_tokenizer import save_char_tokenizer

PROMPT = [5, 9, 14, 3, 22, 7]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    out = tmp_path_factory.mktemp("deltas")
    build_tiny_llama(out, "gqa3_llama3rope_tied_bias_hd40", num_layers=2, vocab_size=64)
    return out, save_char_tokenizer(out)


class _CountingTokenizer:
    """The tokenizer, counting its decode calls."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self.num_decodes = 0

    def decode(self, ids: list[int], **kwargs: Any) -> str:
        self.num_decodes += 1
        return str(self._tokenizer.decode(ids, **kwargs))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)


def engine_for(model: tuple[Path, Any]) -> LLMEngine:
    config = EngineConfig(
        model=str(model[0]), dtype="float32", block_size=4, kv_cache_memory=1 << 21
    )
    return LLMEngine(config, tokenizer=_CountingTokenizer(model[1]))


def greedy(n: int, **kw: Any) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


def offline(model: tuple[Path, Any], requests: dict[str, tuple[list[int], SamplingParams, int]]):
    """Each request's output, the engine stepped offline (``step``)."""
    engine = engine_for(model)
    for rid, (prompt, params, num_sent) in requests.items():
        engine.add_request(rid, prompt, params, num_output_tokens_sent=num_sent)
    done: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        done.update({out.request_id: out for out in engine.step() if out.finished})
    return done


def test_deltas_add_up_to_the_offline_outputs(model):
    """Two requests, one resumed with 3 tokens an earlier attempt sent, logprobs and
    prompt logprobs asked: the first delta of each carries its start (prompt, resumed
    tokens, prompt logprobs), the rest only what their step added; together they are the
    offline outputs, token for token and logprob for logprob."""
    requests = {
        "a": (PROMPT, greedy(9, logprobs=2, prompt_logprobs=1), 0),
        "b": ([*PROMPT, 30, 31, 32], greedy(9, logprobs=1), 3),
    }
    expected = offline(model, requests)
    engine = engine_for(model)
    for rid, (prompt, params, num_sent) in requests.items():
        engine.add_request(rid, prompt, params, num_output_tokens_sent=num_sent)
    deltas: dict[str, list[RequestDelta]] = {"a": [], "b": []}
    while engine.has_unfinished_requests():
        for delta in engine.step_deltas():
            deltas[delta.request_id].append(delta)
    assert engine.tokenizer.num_decodes == 0  # the engine's steps made no text

    for rid, (prompt, params, num_sent) in requests.items():
        first, *rest = deltas[rid]
        assert first.start is not None and first.start.params is params
        assert first.start.prompt_token_ids == prompt[: len(prompt) - num_sent]
        assert first.start.output_token_ids_sent == prompt[len(prompt) - num_sent :]
        assert all(d.start is None and d.prompt_logprobs is None for d in rest)
        assert [d.finished for d in deltas[rid]] == [False] * len(rest) + [True]
        tokens = [t for d in deltas[rid] for t in d.new_token_ids]
        assert [*first.start.output_token_ids_sent, *tokens] == expected[rid].token_ids
        assert [lp for d in deltas[rid] for lp in d.new_logprobs] == expected[rid].logprobs
    assert deltas["a"][0].prompt_logprobs == expected["a"].prompt_logprobs
    assert len(expected["a"].prompt_logprobs or []) == len(PROMPT) - 1
    assert deltas["b"][0].prompt_logprobs is None


def test_a_stop_string_is_found_where_the_deltas_are_assembled(model):
    """As a worker runs it: the stop string (two tokens' text, in the middle of a seeded
    sampled output) is found by the ``OutputProcessor``, the request is dropped only after the
    engine's next step, which went on past it, and the output is the offline one, ended by
    that string; the engine's thread decoded nothing and holds no block after."""
    sampled = SamplingParams(max_tokens=12, temperature=1.0, seed=3, ignore_eos=True)
    plain = offline(model, {"s": (PROMPT, sampled, 0)})["s"]
    assert len(plain.text) == 12  # a character a token
    stop = plain.text[4:6]
    assert stop not in plain.text[:5]
    params = dataclasses.replace(sampled, stop=(stop,))
    expected = offline(model, {"s": (PROMPT, params, 0), "t": (PROMPT[:3], greedy(12), 0)})
    assert expected["s"].stop_reason == stop and expected["s"].token_ids == plain.token_ids[:6]
    assert expected["s"].text == plain.text[:4]

    engine = engine_for(model)
    engine.add_request("s", PROMPT, params)
    engine.add_request("t", PROMPT[:3], greedy(12))
    outputs = OutputProcessor(engine.tokenizer)
    done: dict[str, RequestOutput] = {}
    made = {"s": 0, "t": 0}
    to_drop: list[str] = []
    while engine.has_unfinished_requests():
        deltas = engine.step_deltas()
        assert engine.tokenizer.num_decodes == 0
        for rid in to_drop:  # what the worker's event loop asked for meanwhile
            engine.drop_request(rid)
        to_drop = []
        for delta in deltas:
            made[delta.request_id] += len(delta.new_token_ids)
        for out in outputs.process(deltas):
            if out.finished:
                done[out.request_id] = out
                to_drop.append(out.request_id)
        engine.tokenizer.num_decodes = 0
    assert made["s"] > len(expected["s"].token_ids)  # the engine went on past the stop
    for rid in ("s", "t"):
        assert done[rid].token_ids == expected[rid].token_ids
        assert done[rid].text == expected[rid].text
        assert done[rid].finish_reason == expected[rid].finish_reason
    assert done["s"].finish_reason is FinishReason.STOP and done["s"].stop_reason == stop
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks

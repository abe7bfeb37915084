"""Prompt logprobs (``SamplingParams.prompt_logprobs``) equal transformers' fp32 log-softmax
over the same prompt, with chunked prefill, prefix caching, a draft and max_tokens 0."""

from __future__ import annotations

import pytest
import torch

from engine.sampling_params import SamplingParams, SamplingParamsError
from engine.spec.config import SpeculativeConfig
from tests.engine.test_llm_engine import engine_for, run
from tests.engine.tiny_drafts import build_random_draft
from tests.engine.tiny_models import build_tiny_llama

PROMPT = [1, 7, 33, 4, 9, 16, 25, 36, 49, 5, 60, 12, 3]  # 13 tokens


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):
    out = tmp_path_factory.mktemp("tiny")
    model = build_tiny_llama(out, "gqa3_llama3rope_tied_bias_hd40", num_layers=2, vocab_size=64)
    return out, model


def reference(hf, prompt: list[int]) -> torch.Tensor:
    """[P, V] fp32 log-softmax of transformers' logits at each prompt position."""
    with torch.inference_mode():
        ids = torch.tensor([prompt])
        logits = hf(ids, attention_mask=torch.ones_like(ids)).logits[0].float()
    return torch.log_softmax(logits, -1)


def check(entries, hf, prompt: list[int], k: int) -> None:
    ref = reference(hf, prompt)
    assert [e.token_id for e in entries] == prompt[1:]  # no entry for the first token
    for i, e in enumerate(entries):
        row = ref[i]  # position i predicts prompt token i + 1
        assert abs(e.logprob - row[prompt[i + 1]].item()) < 1e-4, i
        top = row.topk(k)
        assert list(e.top) == top.indices.tolist()
        gaps = [abs(a - b) for a, b in zip(e.top.values(), top.values.tolist(), strict=True)]
        assert max(gaps, default=0.0) < 1e-4


def params(n: int, k: int | None, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, prompt_logprobs=k, **kw)


@pytest.mark.parametrize("chunk", [None, 5])
def test_prompt_logprobs_equal_transformers(tiny, chunk):
    model_dir, hf = tiny
    kw = {"max_num_batched_tokens": chunk} if chunk else {}
    engine = engine_for(model_dir, **kw)
    out = run(
        engine,
        {
            "a": (PROMPT, params(3, 4)),
            "b": (PROMPT[:7], params(2, None)),  # a neighbour that does not ask
            "c": (PROMPT[2:], params(1, 0)),
        },
    )
    check(out["a"].prompt_logprobs, hf, PROMPT, 4)
    check(out["c"].prompt_logprobs, hf, PROMPT[2:], 0)
    assert out["b"].prompt_logprobs is None
    assert len(out["a"].token_ids) == 3


def test_max_tokens_zero_scores_the_prompt_only(tiny):
    model_dir, hf = tiny
    engine = engine_for(model_dir, max_num_batched_tokens=4)
    run(engine, {"warm": (PROMPT, params(1, None))})  # its blocks are in the prefix cache now
    out = run(engine, {"a": (PROMPT, params(0, 2))})["a"]
    assert out.token_ids == [] and out.finish_reason == "length"
    assert out.num_cached_tokens == 0  # every prompt position computed
    check(out.prompt_logprobs, hf, PROMPT, 2)


def test_max_tokens_zero_needs_prompt_logprobs():
    with pytest.raises(SamplingParamsError, match=r"^max_tokens: must be an integer >= 1, got 0"):
        SamplingParams(max_tokens=0)
    with pytest.raises(SamplingParamsError, match=r"^prompt_logprobs: must be in \[0, 20\]"):
        SamplingParams(prompt_logprobs=21)


def test_prompt_logprobs_with_a_draft(tiny, tmp_path):
    """The speculative prefill collects them too; the greedy output is the same as without."""
    model_dir, hf = tiny
    draft = build_random_draft(model_dir, tmp_path / "eagle", "eagle")
    engine = engine_for(
        model_dir,
        speculative=SpeculativeConfig(str(draft), num_draft_tokens=3),
        max_num_batched_tokens=6,
    )
    out = run(engine, {"a": (PROMPT, params(4, 3))})["a"]
    check(out.prompt_logprobs, hf, PROMPT, 3)
    plain = run(engine_for(model_dir), {"a": (PROMPT, params(4, None))})["a"]
    assert out.token_ids == plain.token_ids


def test_smollm2_prompt_logprobs_through_the_offline_llm(smollm2_dir):
    """SmolLM2 in fp32, through ``LLM.generate``, a prompt over three prefill chunks."""
    from transformers import LlamaForCausalLM

    from engine.llm import LLM

    llm = LLM(
        str(smollm2_dir), dtype="float32", kv_cache_memory=64 << 20, max_num_batched_tokens=16
    )
    prompt = llm.tokenizer.encode("The capital of France is Paris, and the capital of Italy is")
    prompt = prompt + prompt[:20]  # longer than two chunks
    out = llm.generate([prompt], params(0, 5), use_tqdm=False)[0]
    hf = LlamaForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    assert out.token_ids == []
    check(out.prompt_logprobs, hf, prompt, 5)

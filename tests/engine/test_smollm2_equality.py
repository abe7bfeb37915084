"""Greedy SmolLM2-135M in fp32: Tandem's mixed-length batch equals transformers' generate alone.

The model is the packaged Q4_1 GGUF, dequantized to 538 MB of fp32 (`tandem models prepare
smollm2`); the test prepares it when it is missing.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer, LlamaForCausalLM

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from tests.comparator import compare_greedy

NEW_TOKENS = 64
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue, for a ten-year-old who loves dinosaurs.",
    "List three prime numbers.",
    "def fibonacci(n):",
    "Translate 'good morning' into Spanish, French and German, and say which sounds nicest.",
    "Hi!",
    "Summarise the plot of Romeo and Juliet. Then give one reason the story is still told today, "
    "and one way a modern retelling might change the ending.",
]


@pytest.fixture(scope="module")
def reference(smollm2_dir):
    model = LlamaForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(smollm2_dir)


def reference_generate(model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=None,
        )
    return out[0, len(prompt) :].tolist()


def chat_ids(tokenizer, question: str) -> list[int]:
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
    )
    return list(tokenizer.encode(text, add_special_tokens=False))


@pytest.mark.slow
def test_greedy_fp32_batch_equals_transformers_alone(smollm2_dir, reference):
    model, tokenizer = reference
    prompts = [chat_ids(tokenizer, q) for q in QUESTIONS]
    assert len({len(p) for p in prompts}) == len(prompts)  # mixed lengths
    llm = LLM(
        str(smollm2_dir), dtype="float32", kv_cache_memory=256 << 20, max_num_batched_tokens=128
    )
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    ours = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    refs = [reference_generate(model, p, NEW_TOKENS) for p in prompts]
    result = compare_greedy(model, prompts, ours, refs)
    assert result.num_ties <= 1, f"too many ties to trust: {result.tie_positions}"
    assert llm.tokenizer.decode(ours[0], skip_special_tokens=True).count("Paris") >= 1


@pytest.mark.slow
def test_stop_strings_on_real_text(smollm2_dir, reference):
    _, tokenizer = reference
    llm = LLM(str(smollm2_dir), dtype="float32", kv_cache_memory=64 << 20)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": QUESTIONS[0]}], add_generation_prompt=True, tokenize=False
    )
    full = llm.generate(
        [prompt], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True), use_tqdm=False
    )[0]
    assert "Paris" in full.text
    stopped = llm.generate(
        [prompt],
        SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=["Paris"]),
        use_tqdm=False,
    )[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == "Paris"
    assert stopped.text == full.text[: full.text.index("Paris")]
    assert len(stopped.token_ids) < len(full.token_ids)
    assert stopped.token_ids == full.token_ids[: len(stopped.token_ids)]

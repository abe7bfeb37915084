"""Tandem's Llama-3 forward against transformers' LlamaForCausalLM in fp32, via the paged cache."""

from __future__ import annotations

import pytest
import torch

from engine.attention.torch_backend import split_rows
from engine.llm_engine import EngineConfig, LLMEngine
from engine.models.llama3 import ReturnHiddenStates
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence

TOL = 1e-4
NUM_DECODE_STEPS = 32


def make_engine(model_dir, **kwargs) -> LLMEngine:
    config = dict(model=str(model_dir), dtype="float32", kv_cache_memory=1 << 22, block_size=4)
    config.update(kwargs)
    return LLMEngine(EngineConfig(**config))


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        t = torch.tensor([ids])
        return model(t, attention_mask=torch.ones_like(t)).logits[0].float()  # [L, V]


def run_teacher_forced(engine: LLMEngine, prompts: list[list[int]], continuations: list[list[int]]):
    """Drives the engine's scheduler and runner, feeding fixed continuations; returns
    ({row: [logits for each sampled position]}, steps with a prompt chunk that does not
    sample, steps whose attention ran as separate groups of rows)."""
    sched, runner, bm = engine.scheduler, engine.runner, engine.block_manager
    seqs = []
    for i, prompt in enumerate(prompts):
        seq = Sequence(f"r{i}", list(prompt), len(prompt), SamplingParams(temperature=0), 0)
        sched.add(seq)
        seqs.append(seq)
    got: dict[int, list[torch.Tensor]] = {i: [] for i in range(len(prompts))}
    num_chunked_steps = num_split_steps = 0
    while sched.has_unfinished:
        batch = sched.schedule()
        inputs = runner.prepare(batch)
        num_chunked_steps += any(not batch.samples(r) for r in range(len(batch.seqs)))
        layout = inputs.layout
        num_split_steps += len(split_rows(layout.query_lens)) > 1
        logits = runner.forward(inputs).logits
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            seq.num_computed_tokens += n
            bm.cache_computed_blocks(seq)
        for j, row in enumerate(inputs.sample_rows):
            seq = batch.seqs[row]
            i = seqs.index(seq)
            got[i].append(logits[j])
            if seq.num_output_tokens == len(continuations[i]):
                sched.finish(seq)
            else:
                seq.token_ids.append(continuations[i][seq.num_output_tokens])
    assert bm.num_free_blocks == bm.num_blocks
    return got, num_chunked_steps, num_split_steps


# A budget of 12 tokens chunks the longer prompts next to decode rows (one attention call);
# 40 puts chunks of more than 16 tokens next to decode rows (attention in two row groups).
@pytest.mark.parametrize("max_num_batched_tokens", [12, 40])
def test_prefill_and_decode_logits_match_transformers(tiny_llama, max_num_batched_tokens):
    model_dir, hf = tiny_llama
    vocab = hf.config.vocab_size
    gen = torch.Generator().manual_seed(1)
    lengths = [1, 7, 19, 33]
    prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]
    continuations = [
        torch.randint(3, vocab, (NUM_DECODE_STEPS,), generator=gen).tolist() for _ in prompts
    ]
    engine = make_engine(model_dir, max_num_batched_tokens=max_num_batched_tokens)
    got, num_chunked_steps, num_split_steps = run_teacher_forced(engine, prompts, continuations)
    assert num_chunked_steps > 0
    assert (num_split_steps > 0) == (max_num_batched_tokens > 16)
    for i, (prompt, cont) in enumerate(zip(prompts, continuations, strict=True)):
        ref = hf_logits(hf, prompt + cont)  # [L, V]
        assert len(got[i]) == NUM_DECODE_STEPS + 1
        for step, logits in enumerate(got[i]):
            pos = len(prompt) - 1 + step
            err = (logits - ref[pos]).abs().max().item()
            assert err < TOL, f"row {i} (prompt {len(prompt)}), step {step}: max |diff| {err:.2e}"


def test_hidden_states_match_transformers(tiny_llama):
    model_dir, hf = tiny_llama
    engine = make_engine(model_dir)
    prompt = list(range(3, 20))
    seq = Sequence("h", list(prompt), len(prompt), SamplingParams(temperature=0), 0)
    engine.scheduler.add(seq)
    batch = engine.scheduler.schedule()
    inputs = engine.runner.prepare(batch)
    layers = tuple(range(hf.config.num_hidden_layers))
    out = engine.runner.forward(inputs, ReturnHiddenStates(layer_ids=layers, final=True))
    with torch.inference_mode():
        t = torch.tensor([prompt])
        ref = hf(t, attention_mask=torch.ones_like(t), output_hidden_states=True).hidden_states
    # transformers: hidden_states[i + 1] is the output of layer i, the last one after the norm.
    for i in layers[:-1]:
        assert (out.hidden_states[i] - ref[i + 1][0]).abs().max().item() < TOL
    assert out.final_hidden_state is not None
    assert (out.final_hidden_state - ref[-1][0]).abs().max().item() < TOL


def test_engine_greedy_batch_matches_transformers_generate(tiny_llama):
    model_dir, hf = tiny_llama
    engine = make_engine(model_dir, max_num_batched_tokens=16)
    prompts = [[5, 9, 4], list(range(3, 40)), [7] * 11, [3, 4, 5, 6, 7, 8]]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o
    for i, p in enumerate(prompts):
        t = torch.tensor([p])
        ref = hf.generate(
            t,
            attention_mask=torch.ones_like(t),
            max_new_tokens=20,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=None,
        )[0, len(p) :].tolist()
        assert outs[str(i)].token_ids == ref
        assert outs[str(i)].finish_reason == "length"


def test_return_n_logits_gives_the_last_tokens_of_each_row(tiny_llama):
    model_dir, hf = tiny_llama
    engine = make_engine(model_dir)
    prompts = [list(range(3, 12)), list(range(20, 25)), [7, 8]]
    for i, p in enumerate(prompts):
        engine.scheduler.add(Sequence(f"n{i}", list(p), len(p), SamplingParams(temperature=0), 0))
    batch = engine.scheduler.schedule()
    inputs = engine.runner.prepare(batch, return_n_logits=3)
    logits = engine.runner.forward(inputs).logits
    expected = [hf_logits(hf, p)[-3:] for p in prompts]
    expected[2] = hf_logits(hf, prompts[2])  # a row shorter than n returns all its tokens
    assert logits.shape[0] == 3 + 3 + 2
    assert (logits - torch.cat(expected)).abs().max().item() < TOL


def test_bf16_logits_on_the_cpu_kernel_are_as_close_to_fp32_as_aten_bf16(tiny_llama):
    """bf16 products on kernels/cpu (every Linear, prefill and decode rows alike) err from
    the fp32 reference no more than aten's bf16 products do."""
    from engine.models.layers import Linear
    from kernels.cpu import bf16_gemm

    if not bf16_gemm.available():
        pytest.skip("the CPU bf16 kernel is not built here (needs AVX2 and a C++ compiler)")
    model_dir, hf = tiny_llama
    gen = torch.Generator().manual_seed(2)
    vocab = hf.config.vocab_size
    prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (5, 23)]
    continuations = [torch.randint(3, vocab, (8,), generator=gen).tolist() for _ in prompts]
    errors = {}
    for name in ("kernel", "aten"):
        engine = make_engine(model_dir, dtype="bfloat16", max_num_batched_tokens=12, cpu_gemm=name)
        linears = [m for m in engine.runner.model.modules() if isinstance(m, Linear)]
        assert all((m._panels is not None) == (name == "kernel") for m in linears)
        got, _, _ = run_teacher_forced(engine, prompts, continuations)
        errors[name] = max(
            (logits.float() - hf_logits(hf, p + c)[len(p) - 1 + step]).abs().max().item()
            for i, (p, c) in enumerate(zip(prompts, continuations, strict=True))
            for step, logits in enumerate(got[i])
        )
    assert 0 < errors["kernel"] <= 1.5 * errors["aten"] + 1e-3, errors

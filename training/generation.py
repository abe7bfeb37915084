"""The target's outputs for many prompts from one engine: what self-distillation data and
self-instruct messages are both made of."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tqdm import tqdm

Log = Callable[[str], None]


def generate_continuations(
    target_dir: str | Path,
    prompts: Sequence[list[int]],
    max_new_tokens: int,
    *,
    num_threads: int | None = None,
    max_num_seqs: int = 64,
    dtype: str = "bfloat16",
    log: Log = print,
) -> tuple[list[list[int]], dict[str, float]]:
    """The target's greedy continuation of every prompt, as served (bf16), in large batches.

    Runs the engine without a tokenizer, so that any target directory works. Returns the
    continuations (ending with EOS when the target stopped) and timing statistics.
    """
    from engine.sampling_params import SamplingParams

    greedy = SamplingParams(max_tokens=max_new_tokens, temperature=0.0)
    outputs, stats = generate(
        target_dir,
        prompts,
        [greedy] * len(prompts),
        num_threads=num_threads,
        max_num_seqs=max_num_seqs,
        dtype=dtype,
        log=log,
    )
    return [out.token_ids for out in outputs], stats


def generate(
    target_dir: str | Path,
    prompts: Sequence[list[int]],
    params: Sequence[Any],  # engine.sampling_params.SamplingParams, one per prompt
    *,
    num_threads: int | None = None,
    max_num_seqs: int = 64,
    dtype: str = "bfloat16",
    desc: str = "generate",
    log: Log = print,
) -> tuple[list[Any], dict[str, float]]:
    """Every prompt's finished ``RequestOutput`` (in order) under its own sampling
    parameters, from one engine over the target, with a progress bar; and timing statistics
    (``tokens`` counts the generated ones)."""
    from engine.config import read_hf_config
    from engine.kv_cache import KVCacheParams
    from engine.llm_engine import EngineConfig, LLMEngine, RequestOutput
    from engine.registry import get_architecture

    if len(params) != len(prompts):
        raise ValueError(f"params: one per prompt, got {len(params)} for {len(prompts)}")
    hf = read_hf_config(target_dir)
    config = get_architecture(hf).config_from_hf(hf, dtype=dtype)
    block_size = 16
    longest = max(len(p) + q.max_tokens for p, q in zip(prompts, params, strict=True))
    per_seq = -(-longest // block_size) + 2
    kv_bytes = KVCacheParams.from_config(config, block_size).bytes_per_block * per_seq
    engine = LLMEngine(
        EngineConfig(
            model=str(target_dir),
            dtype=dtype,
            max_model_len=max(longest + 8, 64),
            block_size=block_size,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=2048,
            kv_cache_memory=kv_bytes * (max_num_seqs + 1),
            num_threads=num_threads,
        )
    )
    for i, (prompt, request_params) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(str(i), list(prompt), request_params)
    outputs: dict[str, RequestOutput] = {}
    start, num_tokens = time.perf_counter(), 0
    with tqdm(total=len(prompts), desc=desc, unit="seq") as bar:
        while engine.has_unfinished_requests():
            for out in engine.step():
                num_tokens += 1
                if out.finished:
                    outputs[out.request_id] = out
                    bar.update(1)
            bar.set_postfix(tok_s=f"{num_tokens / (time.perf_counter() - start):.1f}")
    seconds = time.perf_counter() - start
    log(f"{desc}: {num_tokens} tokens in {seconds:.0f} s ({num_tokens / seconds:.1f} tok/s)")
    stats = {"seconds": seconds, "tokens": float(num_tokens), "tok_s": num_tokens / seconds}
    return [outputs[str(i)] for i in range(len(prompts))], stats


def hf_greedy_sequences(
    target_dir: str | Path,
    device: str,
    seconds: float,
    texts: Sequence[str],
    max_new_tokens: int,
    *,
    ignore_eos: bool = False,
    max_prompt_len: int = 192,
) -> Any:
    """The target's greedy continuations of ``texts`` in its chat template through
    transformers' ``generate`` (bf16 on a GPU, fp32 on CPU), batch after batch (longest
    prompts first) until ``seconds`` have passed: a ``training.data.SequenceSet``.

    A continuation ends with the EOS the target chose, unless ``ignore_eos``: then every
    one is ``max_new_tokens`` long, past EOS, as a benchmark run with EOS ignored serves it.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from training.data import SequenceSet, chat_prompt_ids, special_token_ids

    deadline = time.monotonic() + seconds
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    prompts = chat_prompt_ids(tokenizer, texts, max_prompt_len)
    dtype = torch.bfloat16 if device != "cpu" else torch.float32
    model: Any = AutoModelForCausalLM.from_pretrained(target_dir, dtype=dtype)
    model = model.to(device).eval()
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    pad = eos if pad is None else pad
    if ignore_eos:  # generate reads EOS from here when the call names none
        model.generation_config.eos_token_id = None
    batch_size = 512 if device != "cpu" else 8
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
    sequences, prompt_lens = [], []
    for start in range(0, len(order), batch_size):
        if time.monotonic() >= deadline:
            break
        rows = [prompts[i] for i in order[start : start + batch_size]]
        width = max(map(len, rows))
        ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows], device=device)
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=device)
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=max_new_tokens,
                min_new_tokens=0,
                do_sample=False,
                pad_token_id=pad,
                eos_token_id=None if ignore_eos else eos,
            )
        new_rows = out[:, width:].tolist()
        if ignore_eos and len(new_rows[0]) != max_new_tokens:
            raise RuntimeError(f"generate stopped at {len(new_rows[0])} tokens with EOS ignored")
        for row, new in zip(rows, new_rows, strict=True):
            if not ignore_eos and eos in new:  # kept, as the engine's continuations keep it
                new = new[: new.index(eos) + 1]
            sequences.append(row + new)
            prompt_lens.append(len(row))
    if not sequences:
        raise RuntimeError(f"no sequence was generated within {seconds:.0f} s")
    return SequenceSet(sequences, prompt_lens, special_token_ids(tokenizer))

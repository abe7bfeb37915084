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

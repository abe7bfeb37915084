"""Tensor parallelism on this CPU: a Llama-3-shaped model split over 2 ranks (one thread
each, gloo) against the same model on one rank with two threads.

The model has random bf16 weights, made here once into ``--model-dir``: hidden 1024, 16
heads, 8 KV heads, 16 layers, MLP 2816, vocabulary 32000 (the heads divide by 2). Each
side decodes ``--tokens`` greedy tokens for batches of 1 and of 8 rows, and reports its
median decode step. Both sides run in processes of their own (spawned), one after the
other, on an otherwise idle machine.

No executor starts the ranks yet (issue 37): each rank runs an engine and is given the
same requests, as ``tests/engine/parallel`` does. What the split costs per step is timed
on rank 0: the all-reduces (two per layer) and the all-gather of the logits. The step
inputs' broadcast that an executor will add is not in these figures.

    python bench/parallel.py            # 128 tokens, batches of 1 and 8
    python bench/parallel.py --quick    # 32 tokens

The last line is one JSON object: ``tp_over_tp1_bs1`` and ``tp_over_tp1_bs8`` (TP 2's
decode speed over TP 1's), and per batch the step and collective times in ms.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SHAPE = dict(
    hidden_size=1024,
    num_attention_heads=16,
    num_key_value_heads=8,
    num_hidden_layers=16,
    intermediate_size=2816,
    vocab_size=32000,
)
BATCHES = (1, 8)


def make_model(model_dir: Path) -> None:
    """A random-weight Llama-3-shaped checkpoint (bf16), made once."""
    if (model_dir / "config.json").is_file():
        return
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        **SHAPE,
        max_position_embeddings=2048,
        rope_theta=500000.0,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(str(model_dir))


def decode_steps(
    engine: Any, batch: int, tokens: int, spent: list[float]
) -> list[tuple[float, float]]:
    """Per decode step with every row decoding (the prompts' step left out), for
    ``batch`` rows of ``tokens``: its seconds, and the seconds of ``spent`` (what the
    collectives add to it) in it."""
    from engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    for row in range(batch):
        engine.add_request(f"b{batch}-{row}", [1 + row, 7, 11, 13, 17, 19, 23, 29], params)
    steps = []
    while engine.has_unfinished_requests():
        spent[0] = 0.0
        started = time.perf_counter()
        deltas = engine.step_deltas()
        if len(deltas) == batch and all(d.start is None for d in deltas):
            steps.append((time.perf_counter() - started, spent[0]))
    return steps


def run_side(rank: int, size: int, model_dir: str, init: str, tokens: int, out: str) -> None:
    """One rank (of ``size``): its engine, the decode steps and, on rank 0 of a split
    model, the collectives' time per step; rank 0 writes its figures as JSON."""
    import torch

    from engine.llm_engine import EngineConfig, LLMEngine
    from engine.parallel.group import TensorParallelGroup

    threads = 2 // size
    torch.set_num_threads(threads)
    tp = TensorParallelGroup.join(rank, size, init, timeout_s=120)
    spent = [0.0]
    if size > 1:
        for name in ("all_reduce", "all_gather"):
            collective = getattr(tp, name)

            def timed(*args: Any, _collective: Any = collective, **kwargs: Any) -> Any:
                started = time.perf_counter()
                try:
                    return _collective(*args, **kwargs)
                finally:
                    spent[0] += time.perf_counter() - started

            setattr(tp, name, timed)
    config = EngineConfig(
        model=model_dir,
        dtype="bfloat16",
        num_threads=threads,
        kv_cache_memory=256 << 20,
        tensor_parallel_size=size,
    )
    engine = LLMEngine(config, tp=tp)
    decode_steps(engine, 1, 8, spent)  # warm: first calls, allocations
    figures: dict[str, float] = {}
    for batch in BATCHES:
        steps = decode_steps(engine, batch, tokens, spent)
        figures[f"step_ms_bs{batch}"] = round(statistics.median(s for s, _ in steps) * 1e3, 2)
        collectives = statistics.median(c for _, c in steps)
        figures[f"collectives_ms_bs{batch}"] = round(collectives * 1e3, 3)
    if rank == 0:
        Path(out).write_text(json.dumps(figures))
    tp.close()


def side(size: int, model_dir: Path, tokens: int) -> dict[str, float]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as scratch:
        out = str(Path(scratch) / "figures.json")
        init = f"file://{Path(scratch) / 'rendezvous'}"
        mp.start_processes(
            run_side,
            args=(size, str(model_dir), init, tokens, out),
            nprocs=size,
            start_method="spawn",
        )
        figures: dict[str, float] = json.loads(Path(out).read_text())
        return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=128, help="new tokens per row")
    parser.add_argument("--quick", action="store_true", help="32 tokens")
    parser.add_argument(
        "--model-dir",
        type=Path,
        default=Path(tempfile.gettempdir()) / "tandem-bench-parallel-model",
        help="where the random model is made (once) and read from",
    )
    args = parser.parse_args()
    tokens = 32 if args.quick else args.tokens
    make_model(args.model_dir)
    tp1 = side(1, args.model_dir, tokens)
    print(f"TP 1, 2 threads: {tp1}", flush=True)
    tp2 = side(2, args.model_dir, tokens)
    print(f"TP 2, 1 thread a rank: {tp2}", flush=True)
    result: dict[str, Any] = {
        f"tp_over_tp1_bs{b}": round(tp1[f"step_ms_bs{b}"] / tp2[f"step_ms_bs{b}"], 3)
        for b in BATCHES
    }
    setup = {**SHAPE, "dtype": "bfloat16", "tokens": tokens}
    result.update({"tp1": tp1, "tp2": tp2, "setup": setup})
    print(json.dumps(result))


if __name__ == "__main__":
    main()

"""The engine thread's time per decode step, and how much of it goes to output processing.

Output processing (``engine/output_processor.py``) covers appending each token, the stop
checks, incremental detokenization for stop strings, and building each request's
``RequestOutput``. That is the work that moving to per-step deltas (issue 36) would take
off the thread that steps the model.

The run: SmolLM2 bf16 through ``torch.compile`` (as workers run it), one torch thread,
``--rows`` greedy requests of ``--tokens`` tokens each, with the tokenizer and a stop
string, ``--runs`` times. Steps where every row produced a token are timed with and
without their ``OutputProcessor.append`` / ``output`` calls, and the medians reported.
The last line is one JSON object: ``{"step_ms": [...], "outputs_ms": [...], "share": ...}``.

    python bench/engine_thread.py                 # 8 rows x 128 tokens, 3 runs
    python bench/engine_thread.py --rows 32 --tokens 512
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def timed(spent: list[float], fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - start

    return wrapper


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", help="prepared name or HF directory")
    parser.add_argument("--rows", type=int, default=8, help="requests decoding together")
    parser.add_argument("--tokens", type=int, default=128, help="new tokens per request")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()

    import torch
    from transformers import AutoTokenizer

    import engine.output_processor as output_processor
    from engine.llm_engine import EngineConfig, LLMEngine
    from engine.model_store import prepare
    from engine.sampling_params import SamplingParams

    model_dir = prepare(args.model) if not Path(args.model).is_dir() else Path(args.model)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    torch.set_num_threads(1)
    config = EngineConfig(
        model=str(model_dir), dtype="bfloat16", num_threads=1, max_num_seqs=args.rows
    )
    engine = LLMEngine(config, tokenizer=tokenizer)
    spent = [0.0]
    processor = output_processor.OutputProcessor
    processor.append = timed(spent, processor.append)  # type: ignore[method-assign]
    processor.output = timed(spent, processor.output)  # type: ignore[method-assign]
    params = SamplingParams(
        max_tokens=args.tokens, temperature=0.0, ignore_eos=True, stop=["\n\n\n\n"]
    )
    step_ms, outputs_ms = [], []
    for run in range(args.runs):
        for row in range(args.rows):
            prompt = tokenizer.encode(f"Write a short story about the number {row + 100 * run}.")
            engine.add_request(f"r{run}-{row}", prompt, params)
        steps, outputs = [], []
        while engine.has_unfinished_requests():
            spent[0] = 0.0
            start = time.perf_counter()
            produced = engine.step()
            took = time.perf_counter() - start
            if len(produced) == args.rows:  # every row decoded a token
                steps.append(took)
                outputs.append(spent[0])
        step_ms.append(round(statistics.median(steps) * 1e3, 2))
        outputs_ms.append(round(statistics.median(outputs) * 1e3, 3))
        print(f"run {run}: {step_ms[-1]} ms a step, {outputs_ms[-1]} ms of it outputs", flush=True)
    share = statistics.median(outputs_ms) / statistics.median(step_ms)
    setup = {"model": args.model, "rows": args.rows, "tokens": args.tokens, "threads": 1}
    print(
        json.dumps(
            {"step_ms": step_ms, "outputs_ms": outputs_ms, "share": round(share, 4), "setup": setup}
        )
    )


if __name__ == "__main__":
    main()

"""The engine thread's time per decode step, and the output processing that left it.

A worker's engine thread runs ``LLMEngine.step_deltas``: the step, appending each token and
the stop checks on token ids, and one ``RequestDelta`` per request. Detokenization, stop
strings and each request's cumulative ``RequestOutput`` are assembled off that thread,
where the request is held (``engine/output_processor.py``); before issue 36 the engine
thread did that too, inside its step.

The run: SmolLM2 bf16 through ``torch.compile`` (as workers run it), one torch thread,
``--rows`` greedy requests of ``--tokens`` tokens each, with the tokenizer and a stop
string, ``--runs`` times. Steps where every row produced a token are timed: the engine
thread's ``step_deltas``; within it, what is left of output processing there (appending
tokens with their stop checks, ``StopChecker.append``, and the deltas, ``hand_out``: the
same calls the "before" run timed as ``OutputProcessor.append`` / ``output``); and the
``OutputProcessor.process`` of its deltas, which the engine thread no longer runs. The
medians are reported; the last line is one JSON object: ``{"step_ms": [...],
"thread_outputs_ms": [...], "outputs_ms": [...], "share": ...}`` (share: outputs / step).

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

    import engine.llm_engine as llm_engine
    from engine.llm_engine import EngineConfig, LLMEngine
    from engine.model_store import prepare
    from engine.output_processor import OutputProcessor
    from engine.sampling_params import SamplingParams
    from engine.stop_checker import StopChecker

    model_dir = prepare(args.model) if not Path(args.model).is_dir() else Path(args.model)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    torch.set_num_threads(1)
    config = EngineConfig(
        model=str(model_dir), dtype="bfloat16", num_threads=1, max_num_seqs=args.rows
    )
    engine = LLMEngine(config, tokenizer=tokenizer)
    processor = OutputProcessor(tokenizer)
    spent = [0.0]  # of the step: appending tokens and making the deltas
    StopChecker.append = timed(spent, StopChecker.append)  # type: ignore[method-assign]
    llm_engine.hand_out = timed(spent, llm_engine.hand_out)
    params = SamplingParams(
        max_tokens=args.tokens, temperature=0.0, ignore_eos=True, stop=("\n\n\n\n",)
    )
    step_ms, thread_outputs_ms, outputs_ms = [], [], []
    for run in range(args.runs):
        for row in range(args.rows):
            prompt = tokenizer.encode(f"Write a short story about the number {row + 100 * run}.")
            engine.add_request(f"r{run}-{row}", prompt, params)
        steps, in_thread, outputs = [], [], []
        while engine.has_unfinished_requests():
            spent[0] = 0.0
            start = time.perf_counter()
            deltas = engine.step_deltas()
            stepped = time.perf_counter()
            for output in processor.process(deltas):
                if output.finished:  # a stop string's is still running (not expected here)
                    engine.drop_request(output.request_id)
            processed = time.perf_counter()
            if len(deltas) == args.rows:  # every row decoded a token
                steps.append(stepped - start)
                in_thread.append(spent[0])
                outputs.append(processed - stepped)
        step_ms.append(round(statistics.median(steps) * 1e3, 2))
        thread_outputs_ms.append(round(statistics.median(in_thread) * 1e3, 3))
        outputs_ms.append(round(statistics.median(outputs) * 1e3, 3))
        print(
            f"run {run}: {step_ms[-1]} ms a step on the engine thread, {thread_outputs_ms[-1]} "
            f"ms of it tokens and deltas; {outputs_ms[-1]} ms of outputs assembled off it",
            flush=True,
        )
    share = statistics.median(outputs_ms) / statistics.median(step_ms)
    setup = {"model": args.model, "rows": args.rows, "tokens": args.tokens, "threads": 1}
    print(
        json.dumps(
            {
                "step_ms": step_ms,
                "thread_outputs_ms": thread_outputs_ms,
                "outputs_ms": outputs_ms,
                "share": round(share, 4),
                "setup": setup,
            }
        )
    )


if __name__ == "__main__":
    main()

"""Structured output's cost: JSON-schema requests against the same requests unconstrained,
through one in-process SmolLM2 engine at concurrency 8, with and without EAGLE-3.

Each run submits the requests with at most ``--concurrency`` in flight and counts output
tokens per second; ``mask_ms_per_step_p50`` is the median host time per engine step spent
building and applying masks (engine.structured.rows and engine.spec.grammar), over the
constrained runs. The last line is one JSON object.

    python bench/structured.py [--quick] [--dtype bfloat16] [--threads N]
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer

from engine.llm_engine import EngineConfig, LLMEngine
from engine.model_store import prepare
from engine.sampling_params import SamplingParams, StructuredOutput
from engine.spec import grammar as spec_grammar
from engine.spec.config import SpeculativeConfig
from engine.structured import rows

DRAFT = Path(__file__).resolve().parents[1] / "drafts" / "smollm2" / "eagle3"
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"enum": ["Paris", "Tokyo", "Lima", "Oslo"]},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
    },
    "required": ["name", "age", "city", "hobbies"],
    "additionalProperties": False,
}
TOPICS = [
    "a chef",
    "a pilot",
    "a painter",
    "a student",
    "a doctor",
    "a farmer",
    "a poet",
    "a nurse",
]

MASK_SECONDS: list[float] = []  # host seconds in mask code during the current step


def timed(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            MASK_SECONDS.append(time.perf_counter() - start)

    return wrapper


def instrument() -> None:
    """Times the mask code where the engine calls it (its module globals)."""
    import engine.model_runner as model_runner
    import engine.spec.spec_runner as spec_runner

    model_runner.mask_logits = timed(rows.mask_logits)
    spec_runner.step_fields = timed(spec_grammar.step_fields)
    for name in ("accept", "mask", "advance", "end_drafts"):
        setattr(spec_grammar.StepGrammar, name, timed(getattr(spec_grammar.StepGrammar, name)))


def run(
    engine: LLMEngine, prompts: list[list[int]], params: SamplingParams, concurrency: int
) -> tuple[float, list[float], int]:
    """(output tokens per second, mask ms per step, requests that ended "stop")."""
    pending = list(enumerate(prompts))
    running, num_tokens, num_stopped, per_step = 0, 0, 0, []
    start = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        while pending and running < concurrency:
            i, prompt = pending.pop(0)
            engine.add_request(f"r{i}-{time.monotonic_ns()}", prompt, params)
            running += 1
        MASK_SECONDS.clear()
        for out in engine.step():
            if out.finished:
                running -= 1
                num_tokens += len(out.token_ids)
                num_stopped += out.finish_reason == "stop"
        per_step.append(sum(MASK_SECONDS) * 1e3)
    return num_tokens / (time.perf_counter() - start), per_step, num_stopped


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="8 requests of 48 tokens")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--concurrency", type=int, default=8)
    args = parser.parse_args()
    num_requests, max_tokens = (8, 48) if args.quick else (32, 96)
    model = prepare("smollm2")
    tokenizer = AutoTokenizer.from_pretrained(model)
    prompts = []
    for i in range(num_requests):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": f"Describe {TOPICS[i % len(TOPICS)]} as JSON."}],
            add_generation_prompt=True,
            tokenize=False,
        )
        prompts.append(list(tokenizer.encode(text, add_special_tokens=False)))
    spec = StructuredOutput("json_schema", json.dumps(SCHEMA))
    free = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    constrained = SamplingParams(max_tokens=max_tokens, temperature=0.0, structured_output=spec)
    instrument()
    results: dict[str, Any] = {}
    masks: list[float] = []
    for name, draft in (("", None), ("spec_", DRAFT)):
        speculative = None if draft is None else SpeculativeConfig(str(draft), num_draft_tokens=3)
        config = EngineConfig(
            model=str(model),
            dtype=args.dtype,
            max_num_seqs=args.concurrency,
            num_threads=args.threads,
            speculative=speculative,
            warm_up=True,
        )
        engine = LLMEngine(config, tokenizer)
        run(engine, prompts[:2], constrained, args.concurrency)  # compile the schema
        tok_s, _, _ = run(engine, prompts, free, args.concurrency)
        results[f"unconstrained_{name}tok_s"] = tok_s
        tok_s, per_step, stopped = run(engine, prompts, constrained, args.concurrency)
        results[f"constrained_{name}tok_s"] = tok_s
        results[f"constrained_{name}completed"] = stopped / num_requests
        masks += per_step
    results["mask_ms_per_step_p50"] = statistics.median(masks)
    results["constrained_over_unconstrained"] = (
        results["constrained_tok_s"] / results["unconstrained_tok_s"]
    )
    results["threads"] = torch.get_num_threads()
    print(json.dumps(results))


if __name__ == "__main__":
    main()

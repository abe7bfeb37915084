"""Structured output's cost: JSON-schema requests against the same requests unconstrained,
through one in-process SmolLM2 engine at concurrency 8, with and without EAGLE-3.

Each run submits the requests with at most ``--concurrency`` in flight and counts output
tokens per second; ``mask_ms_per_step_p50`` is the median time per engine step that the
engine's thread spends on masks (waiting for the verification masks, checking greedy rows'
argmaxes and filling the refused ones' masks, applying them, masking drafts, committing
tokens), over the constrained runs. xgrammar's fills (every ``RowGrammar.fill``: sampling,
verification and draft masks, on the worker thread or the engine's) are counted in CPU
time of the filling thread, which other processes' load moves less than wall time:
``fill_[spec_]ms_per_step_mean`` per constrained step, ``fill_ms_per_step_p50`` the median
over steps that filled any (both engines), ``fills_[spec_]per_step_mean`` how many masks a
step fills.
``constrained_[spec_]over_unconstrained`` is the median ratio over the run pairs, each
constrained run against the unconstrained run just before it on the same engine.
The last line is one JSON object.

    python bench/structured.py [--quick] [--repeats N] [--dtype bfloat16] [--threads N]
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
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

MASK_SECONDS: list[float] = []  # the engine thread's seconds in mask code, this step
FILL_SECONDS: list[float] = []  # the filling threads' CPU seconds in xgrammar fills, this step


def timed(
    fn: Callable[..., Any],
    into: list[float] = MASK_SECONDS,
    clock: Callable[[], float] = time.perf_counter,
) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = clock()
        try:
            return fn(*args, **kwargs)
        finally:
            into.append(clock() - start)

    return wrapper


def instrument() -> None:
    """Times the mask code where the engine calls it (its module globals and methods)."""
    import engine.spec.spec_runner as spec_runner
    import engine.spec.unified_step as unified_step

    masks = rows.SamplingMasks
    for name in ("apply", "greedy"):  # greedy: argmax first (absent before it was built)
        if hasattr(masks, name):
            setattr(masks, name, timed(getattr(masks, name)))
    spec_runner.step_fields = timed(spec_grammar.step_fields)
    unified_step.apply_bitmask_rows = timed(unified_step.apply_bitmask_rows)
    for name in ("verify_mask", "accept", "mask", "advance", "end_drafts"):
        setattr(spec_grammar.StepGrammar, name, timed(getattr(spec_grammar.StepGrammar, name)))
    fill = timed(rows.RowGrammar.fill, FILL_SECONDS, time.thread_time)
    rows.RowGrammar.fill = fill  # type: ignore[method-assign]


@dataclass
class Run:
    tok_s: float
    mask_ms: list[float]  # per step, the engine thread's
    fill_ms: list[float]  # per step, the filling threads' CPU time
    num_fills: list[int]  # per step, masks filled
    step_ms: list[float]  # per step, wall
    num_stopped: int  # requests that ended "stop"
    acceptance: float  # accepted drafts / drafts verified (0 without a drafter)


def run(
    engine: LLMEngine, prompts: list[list[int]], params: SamplingParams, concurrency: int
) -> Run:
    pending = list(enumerate(prompts))
    running, num_tokens, num_stopped, per_step, fills, steps = 0, 0, 0, [], [], []
    num_fills = []
    stats = engine.spec.stats if engine.spec is not None else None
    drafted = (stats.num_draft_tokens, stats.num_accepted_tokens) if stats else (0, 0)
    start = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        while pending and running < concurrency:
            i, prompt = pending.pop(0)
            engine.add_request(f"r{i}-{time.monotonic_ns()}", prompt, params)
            running += 1
        MASK_SECONDS.clear()
        FILL_SECONDS.clear()
        step_start = time.perf_counter()
        for out in engine.step():
            if out.finished:
                running -= 1
                num_tokens += len(out.token_ids)
                num_stopped += out.finish_reason == "stop"
        steps.append((time.perf_counter() - step_start) * 1e3)
        per_step.append(sum(MASK_SECONDS) * 1e3)
        fills.append(sum(FILL_SECONDS) * 1e3)
        num_fills.append(len(FILL_SECONDS))
    tok_s = num_tokens / (time.perf_counter() - start)
    verified = stats.num_draft_tokens - drafted[0] if stats else 0
    accepted = stats.num_accepted_tokens - drafted[1] if stats else 0
    acceptance = accepted / verified if verified else 0.0
    return Run(tok_s, per_step, fills, num_fills, steps, num_stopped, acceptance)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="8 requests of 48 tokens")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=1, help="unconstrained/constrained pairs")
    parser.add_argument("--kv-cache-mib", type=int, default=256, help="per engine")
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
    fills: list[float] = []  # per constrained step
    num_fills: list[int] = []
    for name, draft in (("", None), ("spec_", DRAFT)):
        speculative = None if draft is None else SpeculativeConfig(str(draft), num_draft_tokens=3)
        config = EngineConfig(
            model=str(model),
            dtype=args.dtype,
            max_num_seqs=args.concurrency,
            num_threads=args.threads,
            speculative=speculative,
            warm_up=True,
            # 8 requests of ~100 tokens need a few MiB: the default (a tenth of the
            # machine's memory) got the benchmark killed for memory beside others' jobs.
            kv_cache_memory=args.kv_cache_mib << 20,
        )
        engine = LLMEngine(config, tokenizer)
        run(engine, prompts[:2], constrained, args.concurrency)  # compile the schema
        # Unconstrained and constrained runs alternate, so that a load that moves during the
        # benchmark moves both sides; each figure is the median over --repeats pairs.
        free_runs, constrained_runs = [], []
        for _ in range(args.repeats):
            free_runs.append(run(engine, prompts, free, args.concurrency))
            constrained_runs.append(run(engine, prompts, constrained, args.concurrency))
        engine_fills = [f for r in constrained_runs for f in r.fill_ms]
        engine_num_fills = [n for r in constrained_runs for n in r.num_fills]
        results[f"fill_{name}ms_per_step_mean"] = statistics.fmean(engine_fills)
        results[f"fills_{name}per_step_mean"] = statistics.fmean(engine_num_fills)
        masks += [ms for r in constrained_runs for ms in r.mask_ms]
        fills += engine_fills
        num_fills += engine_num_fills
        pairs = zip(free_runs, constrained_runs, strict=True)
        stopped = sum(r.num_stopped for r in constrained_runs)
        results[f"unconstrained_{name}tok_s"] = statistics.median(r.tok_s for r in free_runs)
        results[f"constrained_{name}tok_s"] = statistics.median(r.tok_s for r in constrained_runs)
        results[f"constrained_{name}completed"] = stopped / (num_requests * args.repeats)
        results[f"constrained_{name}over_unconstrained"] = statistics.median(
            c.tok_s / f.tok_s for f, c in pairs
        )
        for side, runs in (("unconstrained", free_runs), ("constrained", constrained_runs)):
            results[f"{side}_{name}step_ms_p50"] = statistics.median(
                ms for r in runs for ms in r.step_ms
            )
            if draft is not None:
                results[f"{side}_{name}acceptance"] = statistics.median(r.acceptance for r in runs)
        del engine
        gc.collect()  # one engine's memory at a time
    results["mask_ms_per_step_p50"] = statistics.median(masks)
    filled = [f for f, n in zip(fills, num_fills, strict=True) if n]  # steps that filled any
    results["fill_ms_per_step_p50"] = statistics.median(filled) if filled else 0.0
    results["threads"] = torch.get_num_threads()
    print(json.dumps(results))


if __name__ == "__main__":
    main()

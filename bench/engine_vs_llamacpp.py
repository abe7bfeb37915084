"""Tandem's engine alone against ``llama-bench`` at batch 1: the same SmolLM2 in bf16, the
same threads, the same number of new tokens, in one run.

- ``llamacpp``: ``llama-bench -m smollm2-bf16.gguf -p 0 -n N -t T`` (its ``tg`` test: N
  tokens generated one at a time from an empty context), the bf16 GGUF that
  ``scripts/build_llama_server`` makes from the same weights.
- ``tandem``: ``LLMEngine`` (bf16, decode steps compiled unless ``--eager``), one request
  of N new tokens, greedy, EOS ignored, after a 1-token prompt; the time from the first
  step to the last (the prompt's step is one token).

Each thread count gets its own engine (inductor bakes the thread count into its kernels).
The two sides alternate ``--repeats`` times and each keeps its best: this VM's speed
drifts by up to a third between minutes. The last line is one JSON object:
``{"tandem_tok_s_t<T>", "llamacpp_bf16_tok_s_t<T>", "tandem_over_llamacpp_t<T>", ...,
"setup"}``.

    python bench/engine_vs_llamacpp.py                 # threads 1 and 2, 128 tokens
    python bench/engine_vs_llamacpp.py --threads 2 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

LLAMA_VERSION = "0.3.36"  # as bench/serving.py
LLAMA_CACHE = Path(os.environ.get("TANDEM_LLAMA_CACHE", "~/.cache/tandem/llama.cpp")).expanduser()


def llama_bench_tok_s(binary: Path, gguf: Path, threads: int, new_tokens: int) -> float:
    """llama-bench's mean tokens/s of one ``tg<new_tokens>`` test (1 repetition)."""
    command = [
        str(binary), "-m", str(gguf), "-p", "0", "-n", str(new_tokens), "-t", str(threads),
        "-r", "1", "-o", "json",
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"llama-bench exited with {done.returncode}: {done.stderr[-2000:]}")
    [test] = json.loads(done.stdout)
    return float(test["avg_ts"])


def tandem_tok_s(engine: Any, new_tokens: int) -> float:
    """One greedy request of ``new_tokens`` after a 1-token prompt; tokens per second."""
    from engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    engine.add_request(f"bench-{time.monotonic_ns()}", [1], params)
    engine.step()  # the prompt's step, and the first token
    start, produced = time.perf_counter(), 1
    while engine.has_unfinished_requests():
        produced += len(engine.step())
    assert produced == new_tokens, produced
    return (new_tokens - 1) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3, help="alternating runs; best kept")
    parser.add_argument("--eager", action="store_true", help="Tandem's decode steps eager")
    parser.add_argument("--llama-dir", type=Path, default=LLAMA_CACHE / LLAMA_VERSION)
    args = parser.parse_args()
    binary = args.llama_dir / "bin" / "llama-bench"
    gguf = args.llama_dir / "gguf" / "smollm2-bf16.gguf"
    if missing := [str(p) for p in (binary, gguf) if not p.is_file()]:
        print(
            f"bench/engine_vs_llamacpp.py: {', '.join(missing)} missing; build llama.cpp and "
            f"the GGUFs once (about 10 minutes on 2 cores):\n  scripts/build_llama_server "
            f"--version {LLAMA_VERSION}",
            file=sys.stderr,
        )
        sys.exit(2)

    import torch

    from engine.llm_engine import EngineConfig, LLMEngine
    from engine.model_store import prepare

    model_dir = prepare("smollm2")
    result: dict[str, Any] = {}
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        started = time.perf_counter()
        engine = LLMEngine(
            EngineConfig(
                model=str(model_dir),
                dtype="bfloat16",
                kv_cache_memory=256 << 20,
                torch_compile=not args.eager,
            )
        )
        print(f"# {threads} thread(s): engine ready in {time.perf_counter() - started:.0f} s")
        ours = theirs = 0.0
        for _ in range(args.repeats):
            ours = max(ours, tandem_tok_s(engine, args.new_tokens))
            theirs = max(theirs, llama_bench_tok_s(binary, gguf, threads, args.new_tokens))
            print(f"  tandem {ours:7.1f}  llama-bench {theirs:7.1f} tok/s (best so far)")
        result[f"tandem_tok_s_t{threads}"] = round(ours, 1)
        result[f"llamacpp_bf16_tok_s_t{threads}"] = round(theirs, 1)
        result[f"tandem_over_llamacpp_t{threads}"] = round(ours / theirs, 3)
        del engine
    result["setup"] = {
        "model": "SmolLM2-135M-Instruct, bf16 (Tandem: the HF weights; llama.cpp: its bf16 GGUF)",
        "batch": 1,
        "new_tokens": args.new_tokens,
        "tandem": "eager" if args.eager else "torch.compile",
        "llama_cpp": f"llama-bench from the llama-cpp-python {LLAMA_VERSION} sdist",
        "repeats": args.repeats,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()

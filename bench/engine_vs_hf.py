"""Tandem's engine vs transformers' generate on SmolLM2-135M, greedy, on this machine.

Both sides run in this one process with the same prompts, threads and dtype, and produce
exactly ``--new-tokens`` tokens per row (EOS ignored). The model is the packaged Q4_1
GGUF dequantized to fp32 (538 MB) and cast to the dtype under test. Also printed: two
batch-1 ceilings, ``roofline_tok_s_bs1`` (1 / the summed best-of-20 time of a batch-1
``F.linear`` for every weight matrix of the model) and ``dram_gbps`` (a large copy).
The last line is one JSON object.

    python bench/engine_vs_hf.py            # bf16 and fp32, batch 1, 8 and 32
    python bench/engine_vs_hf.py --quick    # bf16 only, fewer tokens
    python bench/engine_vs_hf.py --dtypes bfloat16

Each figure is the best of ``--repeats`` interleaved runs: this machine is a shared VM
whose throughput drifts by up to a third between minutes.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from transformers import AutoTokenizer, LlamaForCausalLM

from engine.config import Llama3Config, read_hf_config
from engine.llm_engine import EngineConfig, LLMEngine
from engine.model_store import prepare
from engine.sampling_params import SamplingParams

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain why the sky is blue.",
    "List three prime numbers and explain why they are prime.",
    "Give me a recipe for pancakes.",
    "What is the difference between a list and a tuple in Python?",
    "Tell me a short story about a robot who learns to paint.",
    "How do airplanes stay in the air?",
]


def chat_prompts(tokenizer, n: int) -> list[list[int]]:
    prompts = []
    for i in range(n):
        text = tokenizer.apply_chat_template(
            [
                {
                    "role": "user",
                    "content": QUESTIONS[i % len(QUESTIONS)] + " " * (i // len(QUESTIONS)),
                }
            ],
            add_generation_prompt=True,
            tokenize=False,
        )
        prompts.append(list(tokenizer.encode(text, add_special_tokens=False)))
    return prompts


def best_of(fn: Callable[[], object], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def roofline_tok_s_bs1(config: Llama3Config) -> float:
    """1 / (sum over the model's weight matrices of a batch-1 bf16 F.linear, best of 20)."""
    h, q, kv, inter = config.hidden_size, config.q_size, config.kv_size, config.intermediate_size
    per_layer = [(q, h), (kv, h), (kv, h), (h, q), (inter, h), (inter, h), (h, inter)]
    total = 0.0
    with torch.inference_mode():
        shapes = [(s, config.num_hidden_layers) for s in per_layer] + [((config.vocab_size, h), 1)]
        for (out_f, in_f), count in shapes:
            w = torch.randn(out_f, in_f, dtype=torch.bfloat16)
            x = torch.randn(1, in_f, dtype=torch.bfloat16)
            total += count * best_of(lambda w=w, x=x: F.linear(x, w), 20)
    return 1.0 / total


def dram_gbps() -> float:
    src = torch.ones(256 << 20, dtype=torch.uint8)  # 256 MiB
    dst = torch.empty_like(src)
    dst.copy_(src)
    seconds = best_of(lambda: dst.copy_(src), 5)
    return 2 * src.numel() / seconds / 1e9  # read + write


def tandem_tok_s(engine: LLMEngine, prompts: list[list[int]], new_tokens: int) -> float:
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"bench-{time.monotonic_ns()}-{i}", p, params)
    start, produced = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        produced += len(engine.step())
    assert produced == new_tokens * len(prompts)
    return produced / (time.perf_counter() - start)


def hf_tok_s(model, tokenizer, prompts: list[list[int]], new_tokens: int) -> float:
    tokenizer.padding_side = "left"
    batch = tokenizer.pad({"input_ids": prompts}, return_tensors="pt")
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            **batch,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
        )
    elapsed = time.perf_counter() - start
    assert out.shape[1] - batch["input_ids"].shape[1] == new_tokens
    return len(prompts) * new_tokens / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="bf16 only, 32 new tokens")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument(
        "--dtypes",
        nargs="+",
        choices=["bfloat16", "float32"],
        default=["bfloat16", "float32"],
        help="dtypes to run (--quick: bfloat16)",
    )
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument(
        "--repeats", type=int, default=2, help="runs per side, interleaved; the best is kept"
    )
    parser.add_argument(
        "--eager",
        action="store_true",
        help="Tandem without torch.compile (default: decode steps compiled, "
        "EngineConfig(torch_compile=True); compiling takes about a minute per dtype)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    new_tokens = 32 if args.quick else args.new_tokens
    dtypes = ["bfloat16"] if args.quick else args.dtypes

    model_dir = prepare("smollm2")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    config = Llama3Config.from_hf(read_hf_config(model_dir))
    print(
        f"# {platform.processor() or platform.machine()}, {args.threads} threads, "
        f"torch {torch.__version__}"
    )
    print(
        "# SmolLM2-135M-Instruct: packaged Q4_1 GGUF dequantized to fp32 (538 MB), cast per table"
    )
    print(f"# Tandem decode steps: {'eager' if args.eager else 'torch.compile'}")
    results: dict[str, float] = {
        "roofline_tok_s_bs1": roofline_tok_s_bs1(config),
        "dram_gbps": dram_gbps(),
    }
    for dtype in dtypes:
        started = time.perf_counter()
        engine = LLMEngine(
            EngineConfig(
                model=str(model_dir),
                dtype=dtype,
                kv_cache_memory=1 << 30,
                torch_compile=not args.eager,
            )
        )
        print(f"# {dtype}: engine ready in {time.perf_counter() - started:.0f} s", flush=True)
        hf = LlamaForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
        warm = chat_prompts(tokenizer, 2)
        tandem_tok_s(engine, warm, 4)
        hf_tok_s(hf, tokenizer, warm, 4)
        print(f"\n{dtype}: tok/s, {new_tokens} new tokens per row")
        print(f"{'batch':>5} {'tandem':>9} {'hf':>9} {'ratio':>6}")
        for bs in args.batch_sizes:
            prompts = chat_prompts(tokenizer, bs)
            ours = theirs = 0.0
            for _ in range(args.repeats):  # interleaved, so a noisy neighbour hits both sides
                ours = max(ours, tandem_tok_s(engine, prompts, new_tokens))
                theirs = max(theirs, hf_tok_s(hf, tokenizer, prompts, new_tokens))
            print(f"{bs:>5} {ours:>9.1f} {theirs:>9.1f} {ours / theirs:>6.2f}", flush=True)
            if dtype == "bfloat16":
                results[f"tandem_tok_s_bs{bs}"] = ours
                results[f"hf_tok_s_bs{bs}"] = theirs
                results[f"ratio_bs{bs}"] = ours / theirs
        del engine, hf
    print(
        f"\nroofline_tok_s_bs1 {results['roofline_tok_s_bs1']:.1f}, "
        f"dram {results['dram_gbps']:.1f} GB/s"
    )
    print(json.dumps({k: round(v, 3) for k, v in results.items()}))


if __name__ == "__main__":
    main()

"""Tensor parallelism on this CPU: a Llama-3-shaped model split over 2 ranks (one thread
each) against the same model on one rank with two threads, both through the engine's
executor (``LLMEngine`` with ``tensor_parallel_size``: rank 0 in the engine's process, rank
1 in its own).

The model has random bf16 weights, made here once into ``--model-dir``: hidden 1024, 16
heads, 8 KV heads, 16 layers, MLP 2816, vocabulary 32000 (the heads divide by 2). Each
side decodes ``--tokens`` greedy tokens for batches of 1 and of 8 rows, and reports its
median decode step. Each side runs in a process of its own, one after the other, on an
otherwise idle machine.

Timed on rank 0, per decode step:
- the collectives: the all-reduces (two per layer) and the all-gather of the logits;
- the step inputs' broadcast: encoding them and writing them into the step channel;
- the in-process executor's own cost (TP 1): ``UniprocExecutor.forward`` less the
  model's forward inside it.

With ``--draft``, every side speculates with a random one-layer EAGLE-3 draft of the
model's shapes (K = 3 every step), and TP 2 runs twice: the draft split as the target is
(``engine.spec.split_draft``), and the draft on rank 0 alone
(``draft_tensor_parallel_size=1``). Each decode step then verifies and drafts.

    python bench/parallel.py            # 128 tokens, batches of 1 and 8
    python bench/parallel.py --quick    # 32 tokens
    python bench/parallel.py --torch-compile    # both sides compiled
    python bench/parallel.py --draft --quick    # speculative steps, the draft split or not

The last line is one JSON object: ``tp_over_tp1_bs1`` and ``tp_over_tp1_bs8`` (TP 2's
decode speed over TP 1's), and per batch the step, collective and broadcast times in ms;
with ``--draft``, also ``tp_rank0_draft_over_tp1_bs1`` and ``_bs8`` (the draft on rank 0
alone).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
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
DRAFT_K = 3


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


def make_draft(model_dir: Path) -> Path:
    """A random one-layer EAGLE-3 draft of the model's shapes (bf16), made once."""
    draft_dir = model_dir / "eagle3"
    if (draft_dir / "config.json").is_file():
        return draft_dir
    import torch

    from engine.registry import load_model
    from engine.spec.drafters import new_drafter, save_drafter

    target, _ = load_model(model_dir, dtype="bfloat16")
    hf = json.loads((model_dir / "config.json").read_text())
    layers = hf["num_hidden_layers"]
    hf.update(
        num_hidden_layers=1,
        architectures=["LlamaForCausalLMEagle3"],
        draft_vocab_size=hf["vocab_size"],
        eagle_config={"eagle_aux_hidden_state_layer_ids": [2, layers // 2, layers - 3]},
    )
    drafter = new_drafter("eagle3", hf, target, torch.device("cpu"))  # type: ignore[arg-type]
    save_drafter(drafter, draft_dir, hf, dtype=torch.bfloat16)
    return draft_dir


def decode_steps(
    engine: Any, batch: int, tokens: int, spent: dict[str, float]
) -> list[dict[str, float]]:
    """Per decode step with every row decoding (the prompts' step left out), for
    ``batch`` rows of ``tokens``: its seconds (``step``), and the seconds each timed part
    of ``spent`` took in it."""
    from engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    for row in range(batch):
        engine.add_request(f"b{batch}-{row}", [1 + row, 7, 11, 13, 17, 19, 23, 29], params)
    steps = []
    while engine.has_unfinished_requests():
        for name in spent:
            spent[name] = 0.0
        started = time.perf_counter()
        deltas = engine.step_deltas()
        if len(deltas) == batch and all(d.start is None for d in deltas):
            steps.append({"step": time.perf_counter() - started, **spent})
    return steps


def timed(owner: Any, name: str, spent: dict[str, float], key: str) -> None:
    """Replaces ``owner.name`` (a callable) by one that adds its seconds to ``spent[key]``."""
    import torch

    inner = getattr(owner, name)

    def call(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            spent[key] += time.perf_counter() - started

    # As the collectives are: run between compiled graphs, not traced into them.
    setattr(owner, name, torch.compiler.disable(call))


def run_side(
    size: int, model_dir: str, tokens: int, compiled: bool, draft: str = ""
) -> dict[str, float]:
    """One side: the engine over ``size`` ranks, its decode steps and what they spent.
    ``draft``: "" none, "split" split as the target is, "rank0" on rank 0 alone."""
    from engine.executor.inputs import encode
    from engine.llm_engine import EngineConfig, LLMEngine
    from engine.spec.config import SpeculativeConfig

    speculative = None
    if draft:
        speculative = SpeculativeConfig(
            str(Path(model_dir) / "eagle3"),
            num_draft_tokens=DRAFT_K,
            draft_tensor_parallel_size=1 if draft == "rank0" else None,
        )
    config = EngineConfig(
        model=model_dir,
        dtype="bfloat16",
        num_threads=2,
        kv_cache_memory=256 << 20,
        tensor_parallel_size=size,
        torch_compile=compiled,
        warm_up=compiled,  # compiled before the steps are timed
        speculative=speculative,
    )
    engine = LLMEngine(config)
    executor: Any = engine.runner.executor
    spent = {"forward": 0.0, "model": 0.0}
    timed(executor, "forward", spent, "forward")
    for name in ("model", "decode_model"):
        timed(executor, name, spent, "model")
    if size > 1:
        spent.update(collectives=0.0, broadcast=0.0)
        tp = executor.ranks.tp
        for name in ("_all_reduce", "_all_gather"):  # what the collectives, compiled or not, run
            timed(tp, name, spent, "collectives")
        timed(executor.ranks, "send", spent, "broadcast")
        # Encoding is the broadcast's too: timed around the module's function.
        import engine.executor.multiproc as multiproc

        def encode_timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return encode(*args, **kwargs)
            finally:
                spent["broadcast"] += time.perf_counter() - started

        multiproc.encode = encode_timed
    decode_steps(engine, 1, 8, spent)  # warm: first calls, allocations
    figures: dict[str, float] = {}
    for batch in BATCHES:
        steps = decode_steps(engine, batch, tokens, spent)
        figures[f"step_ms_bs{batch}"] = round(statistics.median(s["step"] for s in steps) * 1e3, 2)
        if size > 1:
            for part in ("collectives", "broadcast"):
                median = statistics.median(s[part] for s in steps)
                figures[f"{part}_ms_bs{batch}"] = round(median * 1e3, 3)
        elif not draft:  # (speculative steps call the forward bound before it was timed)
            overhead = statistics.median(s["forward"] - s["model"] for s in steps)
            figures[f"executor_ms_bs{batch}"] = round(overhead * 1e3, 4)
    engine.close()
    return figures


def side_figures(script: str, args: list[str]) -> dict[str, float]:
    """``script`` run with ``args`` in a fresh process: its last line, as JSON."""
    done = subprocess.run(
        [sys.executable, script, *args], check=True, stdout=subprocess.PIPE, text=True
    )
    figures: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return figures


def side(
    size: int, model_dir: Path, tokens: int, compiled: bool, draft: str = ""
) -> dict[str, float]:
    """``run_side`` in a fresh process (``--side``): its last line is its figures."""
    args = ["--side", str(size), "--model-dir", str(model_dir), "--tokens", str(tokens)]
    args += ["--torch-compile"] if compiled else []
    return side_figures(__file__, [*args, *(["--side-draft", draft] if draft else [])])


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
    parser.add_argument(
        "--torch-compile",
        action="store_true",
        help="both sides' decode steps through torch.compile (each rank compiles its shard, "
        "the collectives as ops of its graphs)",
    )
    parser.add_argument(
        "--draft",
        action="store_true",
        help=f"speculative steps with a random EAGLE-3 draft (K={DRAFT_K}); TP 2 with the "
        "draft split and with it on rank 0 alone",
    )
    parser.add_argument("--side", type=int, help=argparse.SUPPRESS)  # one side, in its process
    parser.add_argument("--side-draft", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    tokens = 32 if args.quick else args.tokens
    compiled = args.torch_compile
    if args.side:
        figures = run_side(args.side, str(args.model_dir), tokens, compiled, args.side_draft)
        print(json.dumps(figures))
        return
    make_model(args.model_dir)
    if args.draft:
        make_draft(args.model_dir)
    draft = "split" if args.draft else ""
    tp1 = side(1, args.model_dir, tokens, compiled, draft)
    print(f"TP 1, 2 threads: {tp1}", flush=True)
    tp2 = side(2, args.model_dir, tokens, compiled, draft)
    print(f"TP 2, 1 thread a rank{', the draft split' if draft else ''}: {tp2}", flush=True)
    result: dict[str, Any] = {
        f"tp_over_tp1_bs{b}": round(tp1[f"step_ms_bs{b}"] / tp2[f"step_ms_bs{b}"], 3)
        for b in BATCHES
    }
    if args.draft:
        rank0 = side(2, args.model_dir, tokens, compiled, "rank0")
        print(f"TP 2, the draft on rank 0 alone: {rank0}", flush=True)
        for b in BATCHES:
            ratio = tp1[f"step_ms_bs{b}"] / rank0[f"step_ms_bs{b}"]
            result[f"tp_rank0_draft_over_tp1_bs{b}"] = round(ratio, 3)
        result["tp2_rank0_draft"] = rank0
    setup = {**SHAPE, "dtype": "bfloat16", "tokens": tokens, "compiled": compiled}
    setup.update(draft=f"eagle3, one layer, K={DRAFT_K}" if args.draft else "none")
    result.update({"tp1": tp1, "tp2": tp2, "setup": setup})
    print(json.dumps(result))


if __name__ == "__main__":
    main()

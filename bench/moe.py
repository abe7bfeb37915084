"""DeepSeek-V3's mixture of experts split over 2 ranks on this CPU: expert parallelism (each
rank holds half the routed experts whole) and tensor parallelism (each rank holds half of
every expert's channels) against one rank with two threads, through the engine's executor
(``LLMEngine`` with ``tensor_parallel_size`` and ``enable_expert_parallel``).

The model is DeepSeek-V3's shape scaled down to fit this machine, made here once into
``--model-dir`` with random bf16 weights: 256 routed experts per MoE layer, 8 chosen per
token among the best 4 of 8 groups, one shared expert, the first layer dense; latent
attention; hidden 1024 (DeepSeek-V3: 7168), an expert 256 channels wide (2048), 4 layers
(61). Each side decodes ``--tokens`` greedy tokens for batches of 1, 8 and 32 rows, and
reports its median decode step, in a process of its own, one side after the other.

Timed on rank 0, per decode step and MoE layer:
- ``moe``: the layer's whole forward (router, its experts, shared expert, combine);
- ``combine``: the all-reduce that adds the ranks' partial outputs. Every rank routes every
  token itself, so there is no dispatch collective: the tokens are on every rank already
  (``dispatch_ms`` is 0, reported as such).

    python bench/moe.py            # 32 tokens a row
    python bench/moe.py --quick    # 8 tokens a row

On CPU this shows what the split costs, not a speed-up from more devices: the two ranks
share the machine's two cores with the one-rank side's two threads. The last line is one
JSON object: ``ep_over_one_bs<B>`` and ``tp_over_one_bs<B>`` (decode speed over one rank's),
and each side's step, MoE and combine times in ms.
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

from bench.parallel import decode_steps, side_figures, timed

SHAPE = dict(
    hidden_size=1024,
    num_hidden_layers=4,
    vocab_size=4096,
    intermediate_size=2048,
    moe_intermediate_size=256,
    n_routed_experts=256,
    num_experts_per_tok=8,
    n_group=8,
    topk_group=4,
    n_shared_experts=1,
    first_k_dense_replace=1,
    num_attention_heads=16,
    q_lora_rank=384,
    kv_lora_rank=128,
    qk_nope_head_dim=64,
    qk_rope_head_dim=32,
    v_head_dim=64,
)
BATCHES = (1, 8, 32)
SIDES = {"one": (1, False), "tp": (2, False), "ep": (2, True)}


def make_model(model_dir: Path) -> None:
    """A random-weight DeepSeek-V3-shaped checkpoint (bf16), made once."""
    if (model_dir / "config.json").is_file():
        return
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    config = DeepseekV3Config(
        **SHAPE,
        num_key_value_heads=SHAPE["num_attention_heads"],
        max_position_embeddings=2048,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    with torch.device("cpu"):
        model = DeepseekV3ForCausalLM(config).to(torch.bfloat16)
    with torch.no_grad():  # a correction bias that spreads the choices
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None:
                gate.e_score_correction_bias.normal_(0, 0.1)
    model.save_pretrained(str(model_dir))


class TimedCombine:
    """A MoE layer's group, whose all-reduce (its combine) adds its seconds to ``spent``."""

    def __init__(self, tp: Any, spent: dict[str, float]) -> None:
        self.tp, self.spent = tp, spent

    def all_reduce(self, x: Any) -> Any:
        started = time.perf_counter()
        try:
            return self.tp.all_reduce(x)
        finally:
            self.spent["combine"] += time.perf_counter() - started


def run_side(name: str, model_dir: str, tokens: int) -> dict[str, float]:
    """One side: the engine over its ranks, its decode steps and what they spent."""
    from engine.llm_engine import EngineConfig, LLMEngine
    from engine.models.moe import DeepseekV3MoE

    size, expert_parallel = SIDES[name]
    engine = LLMEngine(
        EngineConfig(
            model=model_dir,
            dtype="bfloat16",
            num_threads=2,
            kv_cache_memory=64 << 20,
            tensor_parallel_size=size,
            enable_expert_parallel=expert_parallel,
        )
    )
    spent = {"moe": 0.0, "combine": 0.0}
    layers = [m for m in engine.runner.model.modules() if isinstance(m, DeepseekV3MoE)]
    for moe in layers:
        timed(moe, "forward", spent, "moe")
        if size > 1:
            moe.tp = TimedCombine(moe.tp, spent)  # type: ignore[assignment]
    decode_steps(engine, 1, 4, spent)  # warm: first calls, allocations
    figures: dict[str, float] = {}
    for batch in BATCHES:
        steps = decode_steps(engine, batch, tokens, spent)
        figures[f"step_ms_bs{batch}"] = round(statistics.median(s["step"] for s in steps) * 1e3, 2)
        for part in ("moe", "combine"):
            per_layer = statistics.median(s[part] for s in steps) / len(layers)
            figures[f"{part}_ms_per_layer_bs{batch}"] = round(per_layer * 1e3, 3)
        figures[f"dispatch_ms_per_layer_bs{batch}"] = 0.0
    engine.close()
    return figures


def side(name: str, model_dir: Path, tokens: int) -> dict[str, float]:
    """``run_side`` in a fresh process (``--side``): its last line is its figures."""
    args = ["--side", name, "--model-dir", str(model_dir), "--tokens", str(tokens)]
    return side_figures(__file__, args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=32, help="new tokens per row")
    parser.add_argument("--quick", action="store_true", help="8 tokens")
    parser.add_argument(
        "--model-dir",
        type=Path,
        default=Path(tempfile.gettempdir()) / "tandem-bench-moe-model",
        help="where the random model is made (once) and read from",
    )
    parser.add_argument("--side", choices=sorted(SIDES), help=argparse.SUPPRESS)
    args = parser.parse_args()
    tokens = 8 if args.quick else args.tokens
    if args.side:
        print(json.dumps(run_side(args.side, str(args.model_dir), tokens)))
        return
    make_model(args.model_dir)
    figures = {}
    for name in SIDES:
        figures[name] = side(name, args.model_dir, tokens)
        print(f"{name}: {figures[name]}", flush=True)
    one = figures["one"]
    result: dict[str, Any] = {}
    for name in ("ep", "tp"):
        for b in BATCHES:
            ratio = one[f"step_ms_bs{b}"] / figures[name][f"step_ms_bs{b}"]
            result[f"{name}_over_one_bs{b}"] = round(ratio, 3)
    setup = {**SHAPE, "dtype": "bfloat16", "tokens": tokens, "cores": "2 (one rank: 2 threads)"}
    result.update({**figures, "setup": setup})
    print(json.dumps(result))


if __name__ == "__main__":
    main()

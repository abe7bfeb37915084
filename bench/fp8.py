"""Block-FP8 weights on this CPU: a checkpoint whose projections are float8_e4m3fn in
128x128 blocks (DeepSeek-V3's format) against the same model in bf16, through the engine.

The model is ``bench/parallel.py``'s random Llama-3 shape (hidden 1024, 16 layers, MLP
2816, vocabulary 32000), its projections quantized here once (``engine.fp8``). Three
sides, each in a process of its own, one after the other: ``bf16`` (the checkpoint the
FP8 one was made from), ``fp8_keep`` (the projections FP8 in memory, dequantized by each
product) and ``fp8_dequantize`` (dequantized once at load time into bf16 weights that
the packed kernels run; the engine's default). Each decodes ``--tokens`` greedy tokens
at batch 1 and 8 and reports its median decode step and the bytes of its projections'
weights.

    python bench/fp8.py            # 64 tokens
    python bench/fp8.py --quick    # 16 tokens

The last line is one JSON object: tok/s per side and batch, ``fp8_keep_over_bf16_bs1``,
``fp8_dequantize_over_bf16_bs1`` (and ``_bs8``), and the weights' bytes per side.
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

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

SIDES = ("bf16", "fp8_keep", "fp8_dequantize")
BATCHES = (1, 8)
QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_fp8(bf16_dir: Path, fp8_dir: Path) -> None:
    """``bf16_dir``'s checkpoint with its projections in block FP8, made once."""
    if (fp8_dir / "config.json").is_file():
        return
    from safetensors.torch import load_file, save_file

    from engine.fp8 import BlockFp8, quantize_blocks

    tensors: dict[str, Any] = {}
    for path in sorted(bf16_dir.glob("*.safetensors")):
        tensors.update(load_file(path))
    out = {}
    for name, tensor in tensors.items():
        if name.endswith(".weight") and name.split(".")[-2] in QUANTIZED:
            out[name], out[name + "_scale_inv"] = quantize_blocks(tensor, BlockFp8(128, 128))
        else:
            out[name] = tensor
    fp8_dir.mkdir(parents=True, exist_ok=True)
    save_file(out, fp8_dir / "model.safetensors")
    config = json.loads((bf16_dir / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    }
    (fp8_dir / "config.json").write_text(json.dumps(config))


def run_side(side: str, model_dir: str, tokens: int) -> dict[str, float]:
    """In this process: the side's engine, its decode steps at each batch, its bytes."""
    import torch

    from engine.fp8 import Fp8Linear
    from engine.llm_engine import EngineConfig, LLMEngine
    from engine.models.layers import Linear
    from engine.sampling_params import SamplingParams

    torch.set_num_threads(2)
    fp8_weights = "keep" if side == "fp8_keep" else "dequantize"
    engine = LLMEngine(
        EngineConfig(model=model_dir, kv_cache_memory=256 << 20, fp8_weights=fp8_weights)
    )
    result: dict[str, float] = {}
    projections = [
        m
        for name, m in engine.runner.model.named_modules()
        if isinstance(m, (Linear, Fp8Linear)) and name.rsplit(".", 1)[-1] != "lm_head"
    ]
    weight_bytes = 0
    for m in projections:  # whatever layouts its products keep (engine.models.layers)
        tensors = [m.weight, getattr(m, "scale", None), getattr(m, "_panels", None)]
        weight_bytes += sum(t.numel() * t.element_size() for t in tensors if t is not None)
        onednn = getattr(m, "_onednn", None)
        weight_bytes += onednn.nbytes if onednn is not None else 0
    result["projection_mb"] = round(weight_bytes / 1e6, 1)
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    for batch in BATCHES:
        for row in range(batch):
            engine.add_request(f"{batch}-{row}", [1 + row, 7, 11, 13, 17, 19, 23, 29], params)
        engine.step()  # the prompts
        steps = []
        while engine.has_unfinished_requests():
            start = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - start)
        median = statistics.median(steps)
        result[f"tok_s_bs{batch}"] = round(batch / median, 1)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=64, help="new tokens per row")
    parser.add_argument("--quick", action="store_true", help="16 tokens")
    parser.add_argument("--model-dir", type=Path, help="where the models are made (once)")
    parser.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)  # a child's
    parser.add_argument("--side-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    tokens = 16 if args.quick else args.tokens
    if args.side:
        print(json.dumps(run_side(args.side, args.side_dir, tokens)))
        return
    from parallel import make_model  # bench/parallel.py's model

    root = args.model_dir or Path(tempfile.gettempdir()) / "tandem-bench-fp8"
    make_model(root / "bf16")
    make_fp8(root / "bf16", root / "fp8")
    results: dict[str, Any] = {}
    for side in SIDES:
        model_dir = root / ("bf16" if side == "bf16" else "fp8")
        command = [sys.executable, __file__, "--side", side, "--side-dir", str(model_dir)]
        command += ["--tokens", str(tokens)]
        done = subprocess.run(command, capture_output=True, text=True, check=True)
        results[side] = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"{side}: {results[side]}", file=sys.stderr)
    for side in SIDES[1:]:
        for batch in BATCHES:
            ratio = results[side][f"tok_s_bs{batch}"] / results["bf16"][f"tok_s_bs{batch}"]
            results[f"{side}_over_bf16_bs{batch}"] = round(ratio, 3)
    results["tokens"] = tokens
    print(json.dumps(results))


if __name__ == "__main__":
    main()

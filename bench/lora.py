"""LoRA adapters in the offline engine (issue 40): SmolLM2-135M in bf16 serving 8 random
adapters of rank 16 on all seven projections, mixed-adapter requests against base-only
ones, at batches of 1 and 8.

The adapters are made here in PEFT's format, into a temporary directory: ``A`` and ``B``
of every projection (q, k, v, o, gate, up, down) of every layer, random of std ``--std``,
alpha 2r. One engine (eager, or compiled with ``--compile``; ``max_loras`` 8) serves all
of them. At each batch the same prompts of 16 random tokens decode ``--tokens`` greedy
tokens each, EOS ignored, on three sides:

- ``base``: every request without an adapter;
- ``lora``: request i under adapter i mod 8 (at batch 1, repeat r's request under adapter
  r mod 8); a batch-8 step runs 8 groups of one row each, the most a step can have;
- ``plain``: the same requests on a second engine with no adapters loaded (what serving
  adapters costs base requests).

Decode tokens/s counts the steps after the prompts' (the step that makes each request's
first token is left out). The sides alternate ``--repeats`` times; each keeps its median.

Then, in decodes of their own (timers would disturb the figures above), per decode step:
- ``layers_ms``: the time in the adapted projections (``LoraLinear.forward``, the base
  product included); lora's less base's is what adapters add inside the layers (eager
  only: a compiled step does not call the forward);
- ``delta_ms``: the time in the deltas (``engine/lora/ops.py``), wrapped where
  ``engine.lora.layers`` calls them: ``sgmv_ms``, the CPU SGMV kernel
  (``CpuSgmv.add_deltas``, one call per adapted projection, any number of tokens), where
  Tandem's CPU kernels are built; else ``dense_ms`` (``DenseLora.add_deltas``, forwards
  of at most ``DENSE_MAX_TOKENS`` tokens) and ``loop_ms`` (``lora_delta``, longer ones);
- ``mask_ms``: the time in ``LoraStep.column_mask`` (the dense path's mask; 0 with the
  kernel);
- ``shrink_ms`` and ``expand_ms``: the kernel's two halves. It shrinks and expands one
  token chunk after the other with no barrier, so they are timed apart by difference:
  ``shrink_ms`` in a decode of its own whose kernel calls shrink only (no part to
  expand), ``expand_ms`` the whole kernel's ``sgmv_ms`` less it. ``calls`` counts the
  kernel's calls a step (one per adapted projection).

    python bench/lora.py            # 128 tokens a row, 5 repeats
    python bench/lora.py --quick    # 32 tokens a row, 3 repeats

The last line is one JSON object: ``lora_over_base_bs1`` and ``lora_over_base_bs8``
(mixed-adapter decode tokens/s over base-only), each side's tokens/s, and per batch the
step, layer, delta, kernel, mask, shrink and expand times in ms.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

BATCHES = (1, 8)
NUM_ADAPTERS = 8
PROMPT_LEN = 16
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SIDES = ("base", "lora", "plain")
_request_ids = itertools.count()


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def make_adapters(
    model_dir: Path, out: Path, count: int, rank: int, std: float
) -> list[tuple[str, str]]:
    """``count`` random PEFT LoRA adapters of ``rank`` on every projection of the Llama
    in ``model_dir``, written under ``out``: their (name, directory) pairs."""
    import torch
    from safetensors.torch import save_file

    hf = json.loads((model_dir / "config.json").read_text())
    hidden, inter = hf["hidden_size"], hf["intermediate_size"]
    head_dim = hf.get("head_dim") or hidden // hf["num_attention_heads"]
    q, kv = hf["num_attention_heads"] * head_dim, hf["num_key_value_heads"] * head_dim
    widths = (q, kv, kv, hidden, inter, inter, hidden)  # out
    inputs = (hidden, hidden, hidden, q, hidden, hidden, inter)  # in
    gen = torch.Generator().manual_seed(0)
    adapters = []
    for n in range(count):
        tensors = {}
        for layer in range(hf["num_hidden_layers"]):
            for target, rows, cols in zip(TARGETS, widths, inputs, strict=True):
                part = "mlp" if target in TARGETS[4:] else "self_attn"
                name = f"base_model.model.model.layers.{layer}.{part}.{target}"
                for key, shape in (("lora_A", (rank, cols)), ("lora_B", (rows, rank))):
                    weight = torch.randn(shape, generator=gen) * std
                    tensors[f"{name}.{key}.weight"] = weight.to(torch.bfloat16)
        path = out / f"adapter{n}"
        path.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(path / "adapter_model.safetensors"))
        config = {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": str(model_dir),
            "r": rank,
            "lora_alpha": 2 * rank,
            "target_modules": list(TARGETS),
            "bias": "none",
        }
        (path / "adapter_config.json").write_text(json.dumps(config, indent=2))
        adapters.append((f"adapter{n}", str(path)))
    return adapters


def decode(
    engine: Any,
    prompts: Sequence[list[int]],
    loras: Sequence[str | None],
    tokens: int,
    spent: dict[str, float] | None = None,
) -> tuple[float, list[dict[str, float]]]:
    """One request per prompt, under its adapter, of ``tokens`` greedy tokens: the decode
    tokens/s after the step that made every request's first token, and per decode step
    its seconds (``step``) and what each part of ``spent`` took in it."""
    from engine.sampling_params import SamplingParams

    spent = {} if spent is None else spent
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    tag = next(_request_ids)
    for row, (prompt, lora) in enumerate(zip(prompts, loras, strict=True)):
        engine.add_request(f"{tag}-{row}", prompt, params, lora=lora)
    started: set[str] = set()
    while len(started) < len(prompts):  # the prompts' step(s)
        started.update(d.request_id for d in engine.step_deltas() if d.new_token_ids)
    steps = []
    produced = 0
    begin = time.perf_counter()
    while engine.has_unfinished_requests():
        for part in spent:
            spent[part] = 0.0
        step_begin = time.perf_counter()
        deltas = engine.step_deltas()
        steps.append({"step": time.perf_counter() - step_begin, **spent})
        produced += sum(len(d.new_token_ids) for d in deltas)
    elapsed = time.perf_counter() - begin
    assert produced == len(prompts) * (tokens - 1), produced
    return produced / elapsed, steps


def timing(inner: Callable[..., Any], spent: dict[str, float], key: str) -> Callable[..., Any]:
    """``inner``, adding its seconds to ``spent[key]``."""

    def call(*args: Any, **kwargs: Any) -> Any:
        begin = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            spent[key] += time.perf_counter() - begin

    return call


def shrink_only(spent: dict[str, float]) -> Callable[..., Any]:
    """``engine.lora.ops.CpuSgmv.add_deltas`` with no part to expand (set on the class,
    it is the method): the kernel reads each group's adapter's ``A`` and shrinks its
    tokens, and adds nothing into ``y``. Adds its seconds to ``spent["shrink"]`` and its
    calls to ``spent["calls"]``."""
    import torch

    def add_deltas(
        self: Any, y: torch.Tensor, x: torch.Tensor, offsets: list[int], ids: list[int]
    ) -> None:
        begin = time.perf_counter()
        slots = self.slot_ids(ids)
        torch.ops.tandem_cpu.sgmv_add(y, x.contiguous(), self.a, [], [0], [0], offsets, slots)
        spent["shrink"] += time.perf_counter() - begin
        spent["calls"] += 1

    return add_deltas


@contextlib.contextmanager
def patched(owner: Any, name: str, replacement: Any) -> Iterator[None]:
    """``owner.name`` replaced while the block runs."""
    original = getattr(owner, name)
    setattr(owner, name, replacement)
    try:
        yield
    finally:
        setattr(owner, name, original)


def median_ms(steps: list[dict[str, float]], part: str) -> float:
    return round(statistics.median(s[part] for s in steps) * 1e3, 3)


def loras_for(side: str, batch: int, repeat: int) -> list[str | None]:
    """Each row's adapter on ``side``: round-robin over the adapters for lora, else none."""
    if side != "lora":
        return [None] * batch
    return [f"adapter{(repeat * batch + row) % NUM_ADAPTERS}" for row in range(batch)]


def timed_parts(
    engine: Any, prompts: Sequence[list[int]], tokens: int, batch: int, compiled: bool
) -> dict[str, float]:
    """The per-step times of the adapted layers, the deltas (kernel, dense, loop), the
    mask, and the kernel's shrink and expand at ``batch`` (medians over decode steps, in
    ms), from decodes of their own."""
    import engine.lora.layers as layers
    import engine.lora.ops as ops

    figures: dict[str, float] = {}
    spent = {"layers": 0.0, "sgmv": 0.0, "dense": 0.0, "loop": 0.0, "mask": 0.0}
    forward = layers.LoraLinear.forward  # patched in a compiled model, it would recompile
    if not compiled:
        forward = timing(forward, spent, "layers")
    with (
        patched(layers.LoraLinear, "forward", forward),
        patched(ops.CpuSgmv, "add_deltas", timing(ops.CpuSgmv.add_deltas, spent, "sgmv")),
        patched(ops.DenseLora, "add_deltas", timing(ops.DenseLora.add_deltas, spent, "dense")),
        patched(layers, "lora_delta", timing(layers.lora_delta, spent, "loop")),
        patched(layers.LoraStep, "column_mask", timing(layers.LoraStep.column_mask, spent, "mask")),
    ):
        for side in ("base", "lora"):
            _, steps = decode(engine, prompts, loras_for(side, batch, 0), tokens, spent)
            figures[f"{side}_step_ms"] = median_ms(steps, "step")
            figures[f"{side}_layers_ms"] = median_ms(steps, "layers")
            if side == "lora":
                for step in steps:
                    step["delta"] = step["sgmv"] + step["dense"] + step["loop"]
                for part in ("delta", "sgmv", "dense", "loop", "mask"):
                    figures[f"{part}_ms"] = median_ms(steps, part)
    split = {"shrink": 0.0, "calls": 0.0}
    with patched(ops.CpuSgmv, "add_deltas", shrink_only(split)):
        _, steps = decode(engine, prompts, loras_for("lora", batch, 0), tokens, split)
    figures["shrink_ms"] = median_ms(steps, "shrink")
    figures["expand_ms"] = round(figures["sgmv_ms"] - figures["shrink_ms"], 3)
    figures["calls"] = statistics.median(s["calls"] for s in steps)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=128, help="new tokens per request")
    parser.add_argument("--repeats", type=int, default=5, help="alternating runs; medians kept")
    parser.add_argument("--quick", action="store_true", help="32 tokens, 3 repeats")
    parser.add_argument(
        "--compile",
        action="store_true",
        help="both engines compiled (torch.compile, as serving's decode workers run by "
        "default; about three minutes more per engine here) rather than eager",
    )
    parser.add_argument("--rank", type=int, default=16, help="the adapters' rank")
    parser.add_argument("--std", type=float, default=0.01, help="the adapters' weights' std")
    parser.add_argument(
        "--threads",
        type=int,
        default=len(os.sched_getaffinity(0)),
        help="torch threads (default: this process's cores)",
    )
    args = parser.parse_args()
    tokens, repeats = (32, 3) if args.quick else (args.tokens, args.repeats)

    from engine.llm_engine import EngineConfig, LLMEngine
    from engine.model_store import prepare

    began = time.perf_counter()
    model_dir = prepare("smollm2")
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    rng = random.Random(0)
    prompts = [[rng.randrange(3, vocab) for _ in range(PROMPT_LEN)] for _ in range(max(BATCHES))]
    with tempfile.TemporaryDirectory(prefix="tandem-bench-lora-") as tmp:
        adapters = make_adapters(model_dir, Path(tmp), NUM_ADAPTERS, args.rank, args.std)
        common: dict[str, Any] = dict(
            model=str(model_dir),
            dtype="bfloat16",
            num_threads=args.threads,
            kv_cache_memory=256 << 20,
            torch_compile=args.compile,
        )
        lora_engine = LLMEngine(
            EngineConfig(**common, lora_modules=tuple(adapters), max_loras=NUM_ADAPTERS)
        )
        plain_engine = LLMEngine(EngineConfig(**common))
        log(f"# {NUM_ADAPTERS} adapters made, engines ready in {time.perf_counter() - began:.0f} s")
        engines = {"base": lora_engine, "lora": lora_engine, "plain": plain_engine}
        for batch in BATCHES:  # warm: first calls, allocations
            for side in SIDES:
                decode(engines[side], prompts[:batch], loras_for(side, batch, 0), 8)
        rates: dict[str, list[float]] = {f"{s}_bs{b}": [] for s in SIDES for b in BATCHES}
        for repeat in range(repeats):
            for batch in BATCHES:
                order = SIDES if repeat % 2 == 0 else SIDES[::-1]
                for side in order:
                    loras = loras_for(side, batch, repeat)
                    tok_s, _ = decode(engines[side], prompts[:batch], loras, tokens)
                    rates[f"{side}_bs{batch}"].append(tok_s)
                now = {s: round(rates[f"{s}_bs{batch}"][-1], 1) for s in SIDES}
                log(f"  repeat {repeat + 1}/{repeats}, batch {batch}: tok/s {now}")
        result: dict[str, Any] = {}
        medians = {key: statistics.median(values) for key, values in rates.items()}
        for batch in BATCHES:
            base, lora = medians[f"base_bs{batch}"], medians[f"lora_bs{batch}"]
            result[f"lora_over_base_bs{batch}"] = round(lora / base, 3)
        for batch in BATCHES:
            plain = medians[f"plain_bs{batch}"]
            result[f"base_over_plain_bs{batch}"] = round(medians[f"base_bs{batch}"] / plain, 3)
        result.update({f"{key}_tok_s": round(value, 1) for key, value in medians.items()})
        for batch in BATCHES:
            parts = timed_parts(lora_engine, prompts[:batch], tokens, batch, args.compile)
            log(f"  batch {batch}, timed: {parts}")
            result[f"per_step_bs{batch}"] = parts
        lora_engine.close()
        plain_engine.close()
    result["setup"] = {
        "model": f"SmolLM2-135M-Instruct, bf16, {'compiled' if args.compile else 'eager'}",
        "adapters": f"{NUM_ADAPTERS} random, rank {args.rank}, alpha {2 * args.rank}, std "
        f"{args.std}, on {', '.join(TARGETS)}",
        "tokens": tokens,
        "prompt_tokens": PROMPT_LEN,
        "repeats": repeats,
        "threads": args.threads,
        "shrink_expand": "shrink: decodes whose SGMV kernel calls shrink only; expand: the "
        "whole kernel's time less the shrink's",
        "elapsed_s": round(time.perf_counter() - began, 1),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()

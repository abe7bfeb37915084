"""Per-step latency of the unified step, eager against CUDA graph, at batch 1 to 64, with
transformers' ``generate`` on the same device and shapes as the peer, and a roofline.

Two models with random bf16 weights made on the device: (a) SmolLM2-135M's shapes,
(b) Llama-3-8B's. Two settings: K=0 (a plain decode step: no drafts verified, the drafter
idle) and EAGLE-3 at K=5 with synthetic acceptance (NOT lossless: a draft at position j is
accepted with probability ``--rates[j]`` whatever it is; random weights accept nothing
otherwise). Rows are greedy, at a KV length of ``--context`` on blocks of their own (what
the KV holds does not change a step's cost), every step from the same state. "graph" runs
``engine.spec.graph_runner``: on CUDA captured graphs per batch bucket, elsewhere its
uncaptured padded path. Prompts are random token ids: no text or tokenizer is needed.

Roofline for (b) at batch 1: the device's copy bandwidth (a measured device-to-device
copy, read + write bytes over time) over the bytes one step must read (every weight once,
plus the rows' KV); steps/s = bandwidth / bytes.

    PYTHONPATH=. python bench/gpu_step.py                 # on a GPU: both shapes
    PYTHONPATH=. python bench/gpu_step.py --quick         # CPU check: SmolLM2's shape only

``--profile`` also records, at batch 1, each setting's kernels (on CPU its operators) through
``torch.profiler``: time and launches per step, and the costliest kernels by name. It is
what says where a step's time goes beyond its weights' bytes.

On CUDA it also times the W8A8 block-FP8 product (``kernels/triton/fp8_gemm.py``) against
bf16's at one of DeepSeek-V3's shapes, and one DeepSeek-V3 MoE layer at its real shape.

The last line is one JSON object (ms per step by model, setting, mode and batch, and the
headline figures named in issue 24).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from engine.attention import get_backend, select_backend
from engine.components import kernels_for
from engine.config import Llama3Config
from engine.executor.uniproc import UniprocExecutor
from engine.kv_cache import KVCacheParams, PagedKVCache
from engine.models.llama3 import Llama3Model
from engine.models.triton_layers import use_triton_kernels
from engine.sampler import SamplingTensors
from engine.sampling_kernels import sampling_kernels
from engine.sampling_params import SamplingParams
from engine.spec.drafters import DRAFTERS
from engine.spec.graph_runner import (
    PersistentInputBuffers,
    StepGraphRunner,
    StepShape,
    blocks_per_seq,
)
from engine.spec.unified_step import SpecStepInputs, UnifiedStep

BLOCK_SIZE = 16
# HF config.json fields of each shape (the public models' values).
SHAPES: dict[str, dict[str, Any]] = {
    "smollm2": dict(
        hidden_size=576,
        num_attention_heads=9,
        num_key_value_heads=3,
        num_hidden_layers=30,
        intermediate_size=1536,
        vocab_size=49152,
        rope_theta=100000.0,
        tie_word_embeddings=True,
        rms_norm_eps=1e-5,
        max_position_embeddings=8192,
    ),
    "8b": dict(
        hidden_size=4096,
        num_attention_heads=32,
        num_key_value_heads=8,
        num_hidden_layers=32,
        intermediate_size=14336,
        vocab_size=128256,
        rope_theta=500000.0,  # Llama-3-8B: no rope scaling (3.1 adds llama3 scaling)
        tie_word_embeddings=False,
        rms_norm_eps=1e-5,
        max_position_embeddings=8192,
    ),
}
DRAFT_VOCAB = {"smollm2": 32000, "8b": 32000}  # as public EAGLE-3 drafts of these targets


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def init_on_device(module: torch.nn.Module, seed: int) -> None:
    """Random weights drawn on the module's device: normal(0, 0.02), unit norms, no bias."""
    gen: torch.Generator | None = None
    for name, p in module.named_parameters():
        if gen is None:
            gen = torch.Generator(device=p.device).manual_seed(seed)
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        elif name.endswith("bias"):
            p.zero_()
        else:
            p.normal_(0.0, 0.02, generator=gen)


def build_target(hf: dict[str, Any], device: torch.device) -> Llama3Model:
    config = Llama3Config.from_hf(hf, dtype=torch.bfloat16)
    with torch.device("meta"):
        model = Llama3Model(config)
    model = model.to_empty(device=device).to(config.dtype)
    model.finalize()
    init_on_device(model, seed=0)
    model.finalize()  # re-tie shared weights
    return model.eval()


def build_eagle3(name: str, hf: dict[str, Any], target: Llama3Model, device: torch.device):
    n = hf["num_hidden_layers"]
    draft_hf = {
        **hf,
        "num_hidden_layers": 1,
        "tie_word_embeddings": False,
        "architectures": ["LlamaForCausalLMEagle3"],
        "draft_vocab_size": DRAFT_VOCAB[name],
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, n // 2, n - 3]},
    }
    drafter = DRAFTERS["eagle3"](None, draft_hf, target, device)
    init_on_device(drafter, seed=1)  # type: ignore[arg-type]
    drafter.d2t.zero_()  # type: ignore[attr-defined]
    return drafter


def time_per_call(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Seconds per call, after two warm-up calls."""
    for _ in range(2):
        fn()
    sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    sync(device)
    return (time.perf_counter() - start) / repeats


def copy_bandwidth(device: torch.device) -> float:
    """Bytes/s of a device-to-device copy (each byte read once and written once)."""
    n = (1 << 30) if device.type == "cuda" else (1 << 27)
    src = torch.empty(n, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    seconds = time_per_call(lambda: dst.copy_(src), device, 10)
    return 2 * n / seconds


def fp8_gemm_times(device: torch.device) -> dict[str, dict[str, float]]:
    """ms per product of DeepSeek-V3's MLP down projection (2048 -> 7168, 128x128 blocks):
    bf16 ``F.linear`` against the W8A8 block-FP8 kernel (its activations' quantization
    included), by rows."""
    from kernels.triton import fp8_gemm

    n, k = 7168, 2048
    weight = torch.randn(n, k, device=device).to(torch.bfloat16)
    weight_fp8 = weight.float().clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = torch.ones(n, k // 128, device=device)
    times: dict[str, dict[str, float]] = {}
    for rows in (1, 16, 64, 256, 1024):
        x = torch.randn(rows, k, device=device).to(torch.bfloat16)
        bf16 = time_per_call(lambda x=x: torch.nn.functional.linear(x, weight), device, 50)
        w8a8 = time_per_call(
            lambda x=x: fp8_gemm.block_fp8_linear(x, weight_fp8, scale, 128), device, 50
        )
        times[str(rows)] = {"bf16": round(bf16 * 1e3, 4), "w8a8": round(w8a8 * 1e3, 4)}
        log(f"FP8 W8A8 {rows} rows: {w8a8 * 1e3:.3f} ms, bf16 {bf16 * 1e3:.3f} ms")
    return times


def deepseek_moe_times(device: torch.device, **shape: int) -> dict[str, float]:
    """ms per forward of one DeepSeek-V3 MoE layer at its real shape (hidden 7168, 256
    experts of 2048 channels, 8 chosen per token among the best 4 of 8 groups, one shared
    expert; random bf16 weights, 22 GB), eager, by rows."""
    from engine.deepseek_v3_config import DeepseekV3Config
    from engine.models.moe import DeepseekV3MoE

    hf = {
        "hidden_size": 7168, "num_hidden_layers": 61, "vocab_size": 129280,
        "num_attention_heads": 128, "max_position_embeddings": 4096,
        "moe_intermediate_size": 2048, "n_routed_experts": 256, "num_experts_per_tok": 8,
        "n_group": 8, "topk_group": 4, "n_shared_experts": 1, "routed_scaling_factor": 2.5,
        **shape,  # smaller, to try it on CPU
    }  # fmt: skip
    config = DeepseekV3Config.from_hf(hf, dtype="bfloat16")
    with torch.device(device):
        moe = DeepseekV3MoE(config).to(torch.bfloat16)
        for p in moe.parameters():
            p.data.normal_(0, 0.02)
        moe.gate.keep_fp32()
    times: dict[str, float] = {}
    for rows in (1, 8, 32):
        x = torch.randn(rows, config.hidden_size, device=device).to(torch.bfloat16)
        seconds = time_per_call(lambda x=x: moe(x), device, 10)
        times[str(rows)] = round(seconds * 1e3, 3)
        log(f"DeepSeek-V3 MoE layer, {rows} rows: {seconds * 1e3:.2f} ms")
    return times


def profile_calls(fn: Callable[[], object], device: torch.device, steps: int = 5) -> dict[str, Any]:
    """Per step of ``fn``: wall time under the profiler, the kernels' (on CPU the operators')
    summed self time and count, and the 12 costliest by name."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    on_cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    fn()
    sync(device)
    started = time.perf_counter()
    with profile(activities=activities) as prof:
        for _ in range(steps):
            fn()
        sync(device)
    wall_ms = (time.perf_counter() - started) * 1e3 / steps
    rows = []
    for event in prof.key_averages():
        if on_cuda and event.device_type != DeviceType.CUDA:
            continue
        us = event.self_device_time_total if on_cuda else event.self_cpu_time_total
        if us > 0:
            rows.append((us / 1e3 / steps, event.count / steps, event.key))
    rows.sort(reverse=True)
    return {
        "wall_ms": round(wall_ms, 3),
        "busy_ms": round(sum(ms for ms, _, _ in rows), 3),
        "launches": round(sum(n for _, n, _ in rows), 1),
        "top": [{"name": key[:90], "ms": round(ms, 4), "calls": round(n, 1)}
                for ms, n, key in rows[:12]],
    }  # fmt: skip


class StepBench:
    """One model's unified step (K=0 and EAGLE-3 K=5) at each batch size, eager and graph."""

    def __init__(self, name: str, device: torch.device, args: argparse.Namespace) -> None:
        self.name, self.device, self.args = name, device, args
        self.hf = SHAPES[name]
        self.target = build_target(self.hf, device)
        self.drafter = build_eagle3(name, self.hf, self.target, device)
        self.k = 5
        max_batch = max(args.batches)
        width = blocks_per_seq(args.context + 4 * self.k + 8, BLOCK_SIZE)
        self.width = width
        num_blocks = max_batch * width + 1  # the last: the padded rows' scratch block
        config = self.target.config
        self.target_kv = PagedKVCache(
            KVCacheParams.from_config(config, BLOCK_SIZE), num_blocks, device
        )
        draft_params = KVCacheParams.from_config(self.drafter.config, BLOCK_SIZE)
        draft_kv = PagedKVCache(draft_params, num_blocks, device)
        attention = select_backend(device, BLOCK_SIZE)
        backend = get_backend(attention, device=device, block_size=BLOCK_SIZE)
        kernels = kernels_for("auto", attention)  # what the engine runs with on this device
        if kernels == "triton":
            use_triton_kernels(self.target)
            use_triton_kernels(self.drafter)
        self.step = UnifiedStep(
            UniprocExecutor(self.target, self.target_kv, backend).forward,
            self.drafter,
            self.target_kv,
            draft_kv,
            backend,
            acceptance="synthetic",
            synthetic_rates=tuple(args.rates),
            sampling_kernels=sampling_kernels(kernels),
        )
        buffers = PersistentInputBuffers.alloc(
            max_batch, max_batch * (self.k + 1), device, max_blocks_per_seq=width
        )
        self.runner = StepGraphRunner(self.step, buffers, num_blocks - 1)
        if args.profile and device.type == "cuda":
            # The profiler must have run once before capture: replaying graphs captured
            # before its first use can miss kernels or fail (pytorch#75504).
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]):
                pass
        started = time.perf_counter()
        # K=0: a plain step (drafter deferred); K=5: verify 5, propose 5.
        self.runner.capture(
            [StepShape(0, 0, True, True, False), StepShape(5, 5, False, True, False)]
        )
        what = "captured" if self.runner.use_graphs else "set up (no capture)"
        log(f"{name}: {len(self.runner.buckets)} buckets x 2 shapes {what} in "
            f"{time.perf_counter() - started:.1f} s "
            f"(attention {attention}, kernels {kernels})")  # fmt: skip

    def inputs(self, b: int, k: int) -> SpecStepInputs:
        gen = torch.Generator().manual_seed(b)
        vocab = self.hf["vocab_size"]
        tables = torch.arange(b * self.width).view(b, self.width)
        params = [SamplingParams(max_tokens=1, temperature=0.0)] * b
        return SpecStepInputs(
            tokens=torch.randint(0, vocab, (b,), generator=gen).to(self.device),
            draft_tokens=torch.randint(0, vocab, (b, k), generator=gen).to(self.device),
            kv_lens=torch.full((b,), self.args.context, device=self.device),
            block_tables=tables.to(self.device),
            sampling=SamplingTensors.build(params, [0] * b, [self.args.context] * b, self.device),
            max_context_len=self.args.context + 2 * k + 3,
        )

    def run(self) -> dict[str, Any]:
        """{setting: {mode: {batch: ms}}} and the tokens per step of the K=5 setting."""
        out: dict[str, Any] = {
            "k0": {"eager": {}, "graph": {}},
            "eagle3_k5": {"eager": {}, "graph": {}},
        }
        for b in self.args.batches:
            for setting, k in (("k0", 0), ("eagle3_k5", self.k)):
                inputs = self.inputs(b, k)
                defer = k == 0

                def eager(
                    inputs: SpecStepInputs = inputs, k: int = k, defer: bool = defer
                ) -> object:
                    return self.step(inputs, k, defer_drafter=defer)

                def graph(
                    inputs: SpecStepInputs = inputs, k: int = k, defer: bool = defer
                ) -> object:
                    return self.runner(inputs, k, defer_drafter=defer)

                for mode, fn in (("eager", eager), ("graph", graph)):
                    ms = 1e3 * time_per_call(fn, self.device, self.args.repeats)
                    out[setting][mode][b] = round(ms, 3)
                    if self.args.profile and b == 1:
                        try:  # a profiler failure costs the profile, not the timings
                            found = profile_calls(fn, self.device)
                        except Exception as e:
                            log(f"{self.name} {setting} {mode}: profiling failed: {e!r}")
                            continue
                        out.setdefault("profile_bs1", {}).setdefault(setting, {})[mode] = found
                        busy, wall, n = found["busy_ms"], found["wall_ms"], found["launches"]
                        log(f"{self.name} batch 1 {setting} {mode} profiled: "
                            f"{n} launches, {busy} ms busy of {wall} ms")  # fmt: skip
                eager_ms, graph_ms = out[setting]["eager"][b], out[setting]["graph"][b]
                log(f"{self.name} batch {b:3d} {setting:9s}: eager {eager_ms:8.3f} ms  "
                    f"graph {graph_ms:8.3f} ms")  # fmt: skip
        # Expected tokens a K=5 step emits under the synthetic rates (a step's cost does not
        # depend on what it accepts): 1 + sum over j of r_1 * ... * r_j.
        expected, reach = 1.0, 1.0
        for rate in self.args.rates[: self.k]:
            reach *= rate
            expected += reach
        out["eagle3_k5_tokens_per_step"] = round(expected, 4)
        out["graph_steps"] = self.runner.num_graph_steps
        out["eager_fallbacks"] = self.runner.num_eager_steps
        return out

    def weight_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.target.parameters())

    def kv_bytes_per_row(self) -> int:
        return self.args.context * self.target_kv.params.bytes_per_block // BLOCK_SIZE


def hf_generate(
    name: str, device: torch.device, batch: int, new_tokens: int, context: int
) -> float:
    """Tokens/s of transformers' greedy ``generate`` (its defaults: dynamic cache, eager
    PyTorch) on the same shape with random bf16 weights, ``context`` prompt tokens."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**SHAPES[name])
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # made in bf16: no fp32 copy of 8B weights
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(default)
    init_on_device(model, seed=0)
    if config.tie_word_embeddings:
        model.tie_weights()
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, config.vocab_size, (batch, context), generator=gen).to(device)

    def run() -> object:
        return model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            do_sample=False,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            eos_token_id=None,
            pad_token_id=0,
        )

    seconds = time_per_call(run, device, 1)
    return batch * new_tokens / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="SmolLM2's shape only, batches 1 and 4"
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batches", default="1,2,4,8,16,32,64")
    parser.add_argument("--context", type=int, default=512, help="KV length of every row")
    parser.add_argument("--repeats", type=int, default=20, help="timed steps per cell")
    parser.add_argument("--hf-tokens", type=int, default=64, help="tokens generate makes")
    parser.add_argument("--rates", default="0.8,0.7,0.6,0.5,0.4", help="synthetic acceptance")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (CPU)")
    parser.add_argument(
        "--profile", action="store_true", help="profile each batch-1 cell (torch.profiler)"
    )
    args = parser.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]
    args.rates = [float(r) for r in args.rates.split(",")]
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    models = ["smollm2", "8b"]
    if args.quick:
        models = ["smollm2"]
        args.batches = [1, 4]
        args.context, args.repeats, args.hf_tokens = 64, 3, 8
        log("--quick: SmolLM2's shape only, batches 1 and 4, context 64, 3 steps per cell; "
            "no Llama-3-8B figures")  # fmt: skip
    if device.type != "cuda":
        log(f"{device}: no CUDA, so 'graph' is the graph runner's uncaptured padded path")
    name_of_device = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    bandwidth = copy_bandwidth(device)
    log(f"{name_of_device}: device copy bandwidth {bandwidth / 1e9:.1f} GB/s")
    result: dict[str, Any] = {
        "device": name_of_device,
        "dtype": "bfloat16",
        "quick": args.quick,
        "context": args.context,
        "synthetic_rates": args.rates,
        "copy_bandwidth_gb_s": round(bandwidth / 1e9, 2),
        "ms_per_step": {},
    }
    for name in models:
        bench = StepBench(name, device, args)
        cells = bench.run()
        result["ms_per_step"][name] = cells
        if name == "8b":
            step_bytes = bench.weight_bytes() + bench.kv_bytes_per_row()
            roofline = bandwidth / step_bytes
            tandem = 1e3 / cells["k0"]["graph"][1]
            result["roofline_steps_s_8b_bs1"] = round(roofline, 2)
            result["tandem_steps_s_8b_bs1"] = round(tandem, 2)
            result["roofline_fraction_8b_bs1"] = round(tandem / roofline, 4)
            spec = cells["eagle3_k5"]["graph"][1] / cells["k0"]["graph"][1]
            result["spec_step_over_plain_step_8b_bs1"] = round(spec, 3)
        if name == "smollm2":
            plain = 1e3 / cells["k0"]["graph"][1]
            result["tandem_tok_s_smollm2_bs1"] = round(plain, 1)  # K=0: one token a step
            per_step = cells["eagle3_k5_tokens_per_step"]
            spec_tok_s = per_step * 1e3 / cells["eagle3_k5"]["graph"][1]
            result["tandem_spec_tok_s_smollm2_bs1"] = round(spec_tok_s, 1)
        del bench, cells
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        hf_tok_s = hf_generate(name, device, 1, args.hf_tokens, args.context)
        result[f"hf_tok_s_{name}_bs1"] = round(hf_tok_s, 1)
        log(f"{name}: transformers generate {hf_tok_s:.1f} tok/s at batch 1")
        if name != models[-1]:  # what a run cut off later keeps (scripts/gpu_check)
            print(json.dumps({**result, "partial": True}), flush=True)
    if device.type == "cuda":  # the interpreter would take minutes on CPU
        times = fp8_gemm_times(device)
        result["fp8_gemm_ms_deepseek_v3_down"] = times
        result["w8a8_over_bf16_gemm_time_64_rows"] = round(
            times["64"]["w8a8"] / times["64"]["bf16"], 3
        )
        result["moe_layer_ms_deepseek_v3"] = deepseek_moe_times(device)
    else:
        result["fp8_gemm_ms_deepseek_v3_down"] = None
        result["w8a8_over_bf16_gemm_time_64_rows"] = None
        result["moe_layer_ms_deepseek_v3"] = None
    if "8b" not in models:
        for key in ("roofline_steps_s_8b_bs1", "tandem_steps_s_8b_bs1",
                    "roofline_fraction_8b_bs1", "spec_step_over_plain_step_8b_bs1"):  # fmt: skip
            result[key] = None
    print(json.dumps(result))


if __name__ == "__main__":
    main()

"""What a tensor-parallel rank other than rank 0 runs, in a process of its own
(``python -m engine.executor.worker``, started by ``RankGroup``): it joins
the group, loads its shard of the target and its KV heads' pools, and then runs each
forward rank 0 sends it (``engine.executor.inputs``) until told to stop, or until rank 0
is gone; or, for the graph runner's steps, the graphs rank 0 names
(``engine.executor.graph_steps``). It samples nothing and returns nothing: its part of
each forward is its share of the layers' all-reduces and of the logits' gather."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import signal
from dataclasses import dataclass
from typing import Any

import torch

from engine.attention import get_backend
from engine.executor.channel import RankGone, StepChannel
from engine.executor.graph_steps import FollowerGraphs
from engine.executor.inputs import ForwardStep, GraphDefine, decode
from engine.executor.shared_kv import SharedKv
from engine.executor.uniproc import UniprocExecutor, compile_decode_model
from engine.kv_cache import KVCacheParams, PagedKVCache, plan_num_blocks
from engine.models.layers import dequantize_fp8, release_packed_weights, use_packed_gemm
from engine.models.triton_layers import use_triton_kernels
from engine.parallel.group import TensorParallelGroup
from engine.registry import ModelConfig, load_model
from kernels.cpu import extension as cpu_kernels

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankConfig:
    """What a rank other than rank 0 loads: EngineConfig's fields of the target's shard
    and its KV pools (sent to it as JSON)."""

    model: str
    tensor_parallel_size: int
    enable_expert_parallel: bool = False
    data_parallel_size: int = 1
    dtype: str = "bfloat16"
    max_model_len: int | None = None
    block_size: int = 16
    kv_cache_memory: int | None = None
    kv_cache_memory_fraction: float = 0.1
    device: str = "cpu"
    attention_backend: str = "auto"
    kernels: str = "torch"  # resolved by rank 0: "torch", or "triton" (its layers swapped in)
    cpu_gemm: str = "measured"
    fp8_weights: str = "dequantize"  # resolved by rank 0: "dequantize" or "keep"
    build_cpu_kernels: bool = True
    num_threads: int | None = None
    torch_compile: bool = False

    @classmethod
    def of(cls, config: Any) -> RankConfig:
        """The fields of ``config`` (an EngineConfig) that a rank's shard needs."""
        return cls(**{f.name: getattr(config, f.name) for f in dataclasses.fields(cls)})


def load_shard(
    config: Any, tp: TensorParallelGroup, device: torch.device
) -> tuple[torch.nn.Module, ModelConfig]:
    """This rank's part of the target that ``config`` (an EngineConfig or a RankConfig:
    the same fields) names: rank 0's ``build_components`` and the other ranks alike."""
    return load_model(
        config.model,
        dtype=config.dtype,
        max_length=config.max_model_len,
        device=device,
        tp=tp,
        expert_parallel=config.enable_expert_parallel,
        data_parallel_size=config.data_parallel_size,
    )


def load_rank(config: RankConfig, tp: TensorParallelGroup, device: torch.device) -> UniprocExecutor:
    """This rank's shard, packed for the CPU's products, and its KV heads' pools, with as
    many blocks as every rank holds (the collective rank 0's ``build_components`` runs)."""
    if device.type == "cpu":
        cpu_kernels.load(build=config.build_cpu_kernels)
    model, model_config = load_shard(config, tp, device)
    if config.fp8_weights == "dequantize":  # as rank 0's build_components does
        dequantize_fp8(model, model_config.dtype)
    if device.type == "cpu" and config.cpu_gemm != "aten":
        use_packed_gemm(model, config.cpu_gemm)
        release_packed_weights(model)
    if config.kernels == "triton":  # as rank 0's build_components swaps them in
        use_triton_kernels(model, rope=config.attention_backend != "torch")
    whole_params = KVCacheParams.from_config(model_config, config.block_size)
    params = whole_params.for_rank(tp.shard)
    num_blocks = plan_num_blocks(
        [params],
        device,
        memory_bytes=config.kv_cache_memory,
        memory_fraction=config.kv_cache_memory_fraction,
    )
    num_blocks = tp.agree_min(num_blocks)
    backend = get_backend(
        config.attention_backend, device=config.device, block_size=config.block_size
    )
    # As rank 0 opens it (data-parallel ranks' pools hold different requests: their own).
    shared = SharedKv.open(tp, whole_params, num_blocks) if config.data_parallel_size == 1 else None
    kv_cache = PagedKVCache(params, num_blocks, device) if shared is None else shared.rank
    decode_model = compile_decode_model(model, kv_cache) if config.torch_compile else None
    return UniprocExecutor(model, kv_cache, backend, decode_model)


def run_rank(
    rank: int,
    size: int,
    init_method: str,
    config_json: str,
    parent_pid: int,
    channel_fd: int,
    backend: str,
    timeout_s: float,
) -> None:
    """The process of rank ``rank`` (1..size-1)."""
    # Signals to the process group (a terminal's Ctrl-C, a supervisor's SIGTERM) are rank
    # 0's to handle: it stops this rank, or this rank leaves once rank 0 is gone.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    config = RankConfig(**json.loads(config_json))
    torch.set_num_threads(config.num_threads or 1)
    device = torch.device(config.device)
    if device.type == "cuda":  # rank r on the device r places after rank 0's
        device = torch.device("cuda", (device.index or 0) + rank)
        torch.cuda.set_device(device)
    tp = TensorParallelGroup.join(rank, size, init_method, backend=backend, timeout_s=timeout_s)
    channel = StepChannel.attach(parent_pid, channel_fd, size - 1, rank - 1, timeout_s=timeout_s)
    try:
        executor = load_rank(config, tp, device)
        graphs = FollowerGraphs(executor.forward, tp, device)  # the graph runner's steps
        while True:
            step = decode(channel.receive(parent_pid).view(torch.int64), device)
            if step is None:
                return
            if isinstance(step, ForwardStep):
                executor.forward(step.inputs, compiled=step.compiled)
            elif isinstance(step, GraphDefine):
                graphs.define(step)
            else:
                graphs.run(step.graph_id)
    except RankGone:
        return  # rank 0 ended without a word (killed): so does this rank
    finally:
        channel.close()
        tp.close()


def main() -> None:
    parser = argparse.ArgumentParser(
        description="One tensor-parallel rank (1..size-1) of an engine; started by the "
        "engine's rank 0 (engine.executor.multiproc), not by hand."
    )
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--size", type=int, required=True)
    parser.add_argument("--init-method", required=True, help="the group's rendezvous")
    parser.add_argument("--config", required=True, help="RankConfig as JSON")
    parser.add_argument("--parent-pid", type=int, required=True, help="rank 0's process")
    parser.add_argument("--channel-fd", type=int, required=True, help="rank 0's step channel")
    parser.add_argument("--backend", default="gloo")
    parser.add_argument("--timeout-s", type=float, required=True)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format=f"rank {args.rank}: %(message)s")
    run_rank(
        args.rank,
        args.size,
        args.init_method,
        args.config,
        args.parent_pid,
        args.channel_fd,
        args.backend,
        args.timeout_s,
    )


if __name__ == "__main__":
    main()

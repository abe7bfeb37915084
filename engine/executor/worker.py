"""What every rank of a split engine loads (``RankConfig``: rank 0 sends it to the others
as JSON), and its shard of the target (``load_shard``). The other ranks' process is
``engine.rank``."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from engine.parallel.group import TensorParallelGroup
from engine.registry import ModelConfig, load_model


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
    compile_cpp_wrapper: bool = False
    # LoRA adapters (engine.lora), each rank reading its part of them, in rank 0's order
    lora_modules: tuple[tuple[str, str], ...] = ()
    enable_lora: bool = False
    max_lora_rank: int = 64
    max_cpu_loras: int | None = None  # the same first ones kept as rank 0's; then as it says
    # A draft split as the target is (engine.spec.split_draft), "" where there is none or
    # it runs on rank 0 alone: its directory, kind and tapped layers as rank 0 reads them.
    draft_model: str = ""
    draft_kind: str | None = None
    draft_layer_ids: list[int] | None = None

    @classmethod
    def of(cls, config: Any) -> RankConfig:
        """The fields of ``config`` (an EngineConfig) that a rank's shard needs (the
        draft's are set where the draft splits)."""
        fields = [f.name for f in dataclasses.fields(cls) if not f.name.startswith("draft_")]
        return cls(**{name: getattr(config, name) for name in fields})


def load_shard(
    config: Any, tp: TensorParallelGroup, device: torch.device
) -> tuple[torch.nn.Module, ModelConfig]:
    """This rank's part of the target that ``config`` (an EngineConfig or a RankConfig:
    the same fields) names: rank 0's ``build_components`` and the other ranks alike.
    Under data-parallel attention the ranks' subgroups are made first, by every rank."""
    if config.data_parallel_size > 1:
        tp.split_data_parallel(config.data_parallel_size)
    return load_model(
        config.model,
        dtype=config.dtype,
        max_length=config.max_model_len,
        device=device,
        tp=tp,
        expert_parallel=config.enable_expert_parallel,
        data_parallel_size=config.data_parallel_size,
    )

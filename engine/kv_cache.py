"""Paged KV cache: per-layer pools of fixed-size blocks, sized from a memory budget."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import psutil
import torch

from engine.config import KVCacheLayout
from engine.parallel.shard import Shard


class DeclaresKVCacheLayout(Protocol):
    """A model config: it says what its KV cache holds (``engine.config.KVCacheLayout``)."""

    @property
    def kv_cache_layout(self) -> KVCacheLayout: ...

    @property
    def dtype(self) -> torch.dtype: ...


class KVCacheCapacityError(ValueError):
    """The KV cache cannot hold what was asked of it; the message says how much is missing."""


@dataclass(frozen=True)
class KVCacheParams:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    num_tensors: int = 2  # pools per layer: K and V, or 1 (MLA's latent and rope part)

    @classmethod
    def from_config(cls, config: DeclaresKVCacheLayout, block_size: int) -> KVCacheParams:
        if block_size <= 0:
            raise KVCacheCapacityError(f"block_size: must be positive, got {block_size}")
        layout = config.kv_cache_layout
        return cls(
            num_layers=layout.num_layers,
            num_kv_heads=layout.num_kv_heads,
            head_dim=layout.head_dim,
            block_size=block_size,
            dtype=config.dtype,
            num_tensors=layout.num_tensors,
        )

    def for_rank(self, shard: Shard) -> KVCacheParams:
        """A tensor-parallel rank's pools: its KV heads only (engine.parallel.shard)."""
        if shard.size == 1:
            return self
        return dataclasses.replace(self, num_kv_heads=len(shard.kv_heads(self.num_kv_heads)))

    @property
    def bytes_per_block(self) -> int:
        """Every pool's share of one block across all layers."""
        elem = torch.empty(0, dtype=self.dtype).element_size()
        per_layer = self.num_tensors * self.block_size * self.num_kv_heads * self.head_dim
        return self.num_layers * per_layer * elem


def device_memory(device: torch.device) -> tuple[int, int]:
    """Bytes (free for new allocations, total) of ``device``."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return int(free), int(total)
    memory = psutil.virtual_memory()
    return int(memory.available), int(memory.total)


def estimate_kv_cache_size(
    params: KVCacheParams | Sequence[KVCacheParams], available_cache_memory: int
) -> int:
    """Bytes of KV cache that fit in ``available_cache_memory``, rounded down to whole blocks."""
    block = block_bytes(params)
    return (available_cache_memory // block) * block


def block_bytes(params: KVCacheParams | Sequence[KVCacheParams]) -> int:
    """Bytes of one block id: in each of the caches it indexes (a target's and a draft's)."""
    if isinstance(params, KVCacheParams):
        return params.bytes_per_block
    return sum(p.bytes_per_block for p in params)


def plan_num_blocks(
    params: KVCacheParams | Sequence[KVCacheParams],
    device: torch.device,
    *,
    memory_bytes: int | None = None,
    memory_fraction: float | None = None,
) -> int:
    """Number of blocks from a byte budget, or from a fraction of the device's total memory:
    configuration, never what happens to be free, so that a worker restarted on a busy
    host gets the capacity it had (and the router's picture of it holds). A budget that
    does not fit in the memory free now is refused, with what to do."""
    free, total = device_memory(device)
    if memory_bytes is None:
        fraction = 0.1 if memory_fraction is None else memory_fraction
        if not 0 < fraction <= 1:
            raise KVCacheCapacityError(
                f"kv_cache_memory_fraction: must be in (0, 1], got {fraction}"
            )
        memory_bytes = int(total * fraction)
        budget = f"kv_cache_memory_fraction {fraction:g} of {total / 1e9:.2f} GB"
    else:
        budget = "kv_cache_memory"
    num_blocks = estimate_kv_cache_size(params, memory_bytes) // block_bytes(params)
    if num_blocks < 1:
        raise KVCacheCapacityError(
            f"kv cache: {memory_bytes} bytes hold no block of {block_bytes(params)} bytes; "
            "raise kv_cache_memory or lower block_size"
        )
    if memory_bytes > free:
        raise KVCacheCapacityError(
            f"kv cache: {memory_bytes / 1e9:.2f} GB ({budget}) does not fit in the "
            f"{free / 1e9:.2f} GB free on {device}; set a smaller kv_cache_memory "
            "(--kv-cache-memory BYTES) or free memory"
        )
    return num_blocks


class PagedKVCache:
    """The pools of every layer (K and V, or MLA's one), each ``[num_blocks, block_size,
    num_kv_heads, head_dim]``.

    Block ``b`` of every layer belongs to the same owner, so one block table serves all
    layers, and a run of consecutive block ids is one contiguous slice of each pool.
    """

    def __init__(
        self,
        params: KVCacheParams,
        num_blocks: int,
        device: torch.device,
        layers: Sequence[tuple[torch.Tensor, ...]] | None = None,
    ) -> None:
        """New zeroed pools, or ``layers``: pools that lie elsewhere, each of this shape
        (a tensor-parallel rank's heads of a pool every rank maps: engine.executor.shared_kv),
        which then stay where they are (``is_placeable`` False)."""
        self.params = params
        self.num_blocks = num_blocks
        shape = (num_blocks, params.block_size, params.num_kv_heads, params.head_dim)
        self.is_placeable = layers is None
        if layers is None:
            layers = [
                tuple(
                    torch.zeros(shape, dtype=params.dtype, device=device)
                    for _ in range(params.num_tensors)
                )
                for _ in range(params.num_layers)
            ]
        for kv in layers:
            if len(kv) != params.num_tensors or any(
                t.shape != shape or t.dtype != params.dtype for t in kv
            ):
                raise ValueError(
                    f"layers: each must be {params.num_tensors} {params.dtype} {shape}"
                )
        self.layers: list[tuple[torch.Tensor, ...]] = [tuple(kv) for kv in layers]

    def pin(self) -> None:
        """The pools' addresses are held elsewhere (captured CUDA graphs): they stay where
        they are (``place`` refuses) until that holder lets them go
        (``StepGraphRunner.release``)."""
        self.is_placeable = False

    def place(self, storage: Callable[[torch.Size, torch.dtype], torch.Tensor]) -> None:
        """Moves every pool into a tensor from ``storage`` (e.g. shared memory another
        process maps), contents kept; each tensor keeps its identity, so holders of
        ``layers`` see the move."""
        if not self.is_placeable:
            raise ValueError(
                "place: these pools are shared with other ranks, or captured in CUDA graphs; "
                "they stay put"
            )
        for kv in self.layers:
            for t in kv:
                moved = storage(t.shape, t.dtype)
                moved.copy_(t)
                t.set_(moved)  # type: ignore[call-overload]

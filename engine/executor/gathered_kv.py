"""A tensor-parallel worker's KV for transfers where its ranks share no memory: CUDA ranks,
each with its own GPU (or CPU ranks with the shared segment turned off,
``TANDEM_TP_SHARED_KV=0``, which is how CPU tests run CUDA's path). Each rank's pools hold
its own KV heads, as they do anyway; rank 0 also keeps ``whole``, a copy of every head in
host memory, and that copy is what a KV transfer reads and writes (the engine's
``kv_pools``), so that the wire carries whole heads and workers of any tensor-parallel
sizes map onto each other, as with the shared segment (engine.executor.shared_kv).

Rank 0 fills the copy and spreads it with collectives that every rank joins, the others
on rank 0's word (an ``OP_KV`` step message, ``engine.executor.inputs``):

- ``gather(slots)``: after a prefill worker's forward wrote KV at ``slots``, every rank's
  heads there, layer by layer, into rank 0's copy. The layer listener (the pushes) is told
  of a step's layers once all of them are gathered, not as each is written: the price of
  this path against the shared segment's.
- ``scatter(blocks)``: once a decode worker has received a request's KV into rank 0's copy,
  each rank's heads of those blocks, layer by layer, into its pools, before the request's
  first step.

Both use the collectives NCCL and gloo share: an all-gather and a broadcast. Each carries
every head to every rank, more than each needs, one layer's tokens at a time. The copy
takes host memory for the worker's whole KV (every rank's blocks), checked at start-up.
"""

from __future__ import annotations

import torch

from engine.kv_cache import KVCacheParams, PagedKVCache, device_memory
from engine.parallel.group import TensorParallelGroup

HOST = torch.device("cpu")


def check_host_memory(params: KVCacheParams, num_blocks: int) -> None:
    """Refuses a copy that the host's free memory cannot hold (the blocks were sized for
    the ranks' own memory, a GPU's), naming the numbers and what to lower."""
    needed = params.bytes_per_block * num_blocks
    free, _ = device_memory(HOST)
    if needed > free:
        raise ValueError(
            f"kv_cache_memory: rank 0's host copy of every KV head ({num_blocks} blocks of "
            f"{params.bytes_per_block} bytes, {needed / 1e9:.2f} GB) does not fit in the "
            f"host's {free / 1e9:.2f} GB free; lower kv_cache_memory or "
            "kv_cache_memory_fraction, or give the host more memory"
        )


class GatheredKv:
    """One pool's copy on rank 0 (``whole``; None on the other ranks) and this rank's pools
    (``rank_kv``); ``gather`` and ``scatter`` are collectives."""

    def __init__(
        self, tp: TensorParallelGroup, whole_params: KVCacheParams, rank_kv: PagedKVCache
    ) -> None:
        self.tp, self.rank_kv = tp, rank_kv
        self.num_heads = whole_params.num_kv_heads
        self.heads = tp.shard.kv_heads(self.num_heads)
        # Fewer KV heads than ranks: each head on ``replicas`` consecutive ranks.
        self.replicas = max(1, tp.size // self.num_heads)
        self.whole: PagedKVCache | None = None
        if tp.shard.rank == 0:
            check_host_memory(whole_params, rank_kv.num_blocks)
            self.whole = PagedKVCache(whole_params, rank_kv.num_blocks, HOST)

    def gather(self, slots: torch.Tensor) -> None:
        """Every rank's heads at ``slots`` (int64, flat slot ids) into rank 0's copy."""
        slots = slots.to(self.rank_kv.layers[0][0].device)
        host_slots = slots.to(HOST)
        for layer, kv in enumerate(self.rank_kv.layers):
            mine = torch.stack([t.flatten(0, 1)[slots] for t in kv])  # [tensors, S, h, D]
            every = self.tp.all_gather(mine, dim=2)[:, :, :: self.replicas]  # rank order
            if self.whole is None:
                continue
            for t, part in zip(self.whole.layers[layer], every, strict=True):
                t.flatten(0, 1).index_copy_(0, host_slots, part.to(HOST))

    def scatter(self, blocks: torch.Tensor) -> None:
        """Rank 0's copy of ``blocks`` (int64 block ids) into each rank's pools, its heads."""
        first = self.rank_kv.layers[0][0]
        blocks = blocks.to(first.device)
        params = self.rank_kv.params
        for layer, kv in enumerate(self.rank_kv.layers):
            if self.whole is not None:
                pools = self.whole.layers[layer]
                every = torch.stack([t[blocks.to(HOST)] for t in pools]).to(first.device)
            else:
                shape = (
                    params.num_tensors,
                    len(blocks),
                    params.block_size,
                    self.num_heads,
                    params.head_dim,
                )
                every = torch.empty(shape, dtype=first.dtype, device=first.device)
            every = self.tp.broadcast(every)
            for t, part in zip(kv, every, strict=True):
                t.index_copy_(0, blocks, part[:, :, self.heads.start : self.heads.stop])

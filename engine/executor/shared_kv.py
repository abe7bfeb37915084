"""A tensor-parallel worker's target KV (and a split draft's) in one shared-memory file on
its host: each layer's K and V with every KV head, ``[num_blocks, block_size,
num_kv_heads, head_dim]``, and each rank's pools are views of the heads it holds
(``Shard.kv_heads``).

Rank 0 reads and writes every head there, so that a KV transfer (kv_transfer, through the
engine's ``kv_pools``) sees one worker's whole KV in one layout, whatever its ranks: the
wire carries whole heads, and prefill and decode workers of any tensor-parallel sizes
map onto each other. Nothing is gathered or copied between ranks for it.

- **Ordering.** A rank writes a layer's KV before that layer's all-reduce returns on any
  rank, so once rank 0's forward has passed layer ``i`` (``on_layer(i)``), every head of
  layer ``i`` is written. KV that rank 0 writes (a pushed request's) is read by the other
  ranks only in a later step, whose message is published after it (channel.py: x86 TSO).
- **Replicated heads.** With fewer KV heads than ranks, the ranks that share a head share
  its memory too. Each writes the same values (the same weights' rows times the same
  all-reduced input), so either write leaves the same bytes, as long as the ranks run the
  same products: ranks that chose different CPU products for the shape (``cpu_gemm``
  "measured", timed per rank) may round differently, and a slot then holds one rank's
  rounding of it (within fp rounding of the other's; tested greedy at TP 4 over 2 KV heads).
- **Data-parallel ranks** (``by_blocks``): each data-parallel rank's pool holds its own
  requests, so the file holds every data-parallel rank's ``num_blocks`` blocks one after
  the other, rank r's block b at ``r * num_blocks + b`` of the whole pool
  (``engine.dp_blocks.whole_table``); with tensor parallelism inside each, its ranks hold
  their heads of its blocks, as above (MLA's one latent head: all of them). Rank 0 reads
  and writes any rank's blocks there for a transfer; a rank writes a forward's KV before
  the forward's last collective (its logits' gather), so once rank 0's forward returns,
  every rank's KV of it is written.
- **Where.** CPU ranks of one host (where their collectives share memory too); elsewhere
  (CUDA, ranks on several hosts) each rank's pools are its own, and rank 0 gathers and
  scatters a whole copy for transfers (engine.executor.gathered_kv). ``TANDEM_TP_SHARED_KV=0``
  in the environment makes CPU ranks do so too (tests of that path, without a GPU).
"""

from __future__ import annotations

import mmap
import os

import torch

from engine.kv_cache import KVCacheParams, PagedKVCache
from engine.parallel.group import TensorParallelGroup
from engine.parallel.shard import Shard
from engine.parallel.shm_collectives import map_shared_file

SHARED_ENV = "TANDEM_TP_SHARED_KV"  # "0": no shared segment, as on CUDA
LABEL = "tandem-tp-kv"  # the target's; a split draft's: DRAFT_LABEL
DRAFT_LABEL = "tandem-tp-draft-kv"


class SharedKv:
    """Every rank's view of the file: ``whole`` (every head) and ``rank`` (its heads)."""

    def __init__(self, mapped: mmap.mmap, whole: PagedKVCache, rank: PagedKVCache) -> None:
        self._map = mapped  # kept: the views live in it
        self.whole, self.rank = whole, rank

    @classmethod
    def open(
        cls,
        tp: TensorParallelGroup,
        params: KVCacheParams,
        num_blocks: int,
        label: str = LABEL,
        *,
        by_blocks: bool = False,
        split_heads: bool = True,
    ) -> SharedKv | None:
        """The ranks' shared pools (a collective: every rank calls it alike) of
        ``params``'s whole heads, each rank's its heads of them or, ``by_blocks``
        (data-parallel ranks), its data-parallel rank's ``num_blocks`` blocks (of its heads,
        unless ``split_heads`` is False); None on every rank where they do not share
        memory."""
        if tp.size == 1 or tp.shm is None or os.environ.get(SHARED_ENV) == "0":
            return None  # the ranks inherit rank 0's environment: None on every rank
        num_ranks, region, heads_shard = 1, 0, tp.shard
        if by_blocks:  # each data-parallel rank's blocks; its ranks' heads of them
            assert tp.data_parallel is not None, "split_data_parallel first"
            rows, heads_shard = tp.data_parallel.rows.shard, tp.data_parallel.attention.shard
            num_ranks, region = rows.size, rows.rank
        if not split_heads:  # a model whole on every rank (a draft beside each rank's rows)
            heads_shard = Shard(0, 1)
        shape = (num_ranks * num_blocks, params.block_size, params.num_kv_heads, params.head_dim)
        tensor_bytes = torch.Size(shape).numel() * params.dtype.itemsize
        num_tensors = params.num_layers * params.num_tensors
        mapped = map_shared_file(tp.shard.rank, label, max(num_tensors * tensor_bytes, 1))
        if mapped is None:
            return None
        data = torch.frombuffer(mapped, dtype=torch.uint8)
        tensors = data.view(params.dtype).view(num_tensors, *shape)
        layers = [
            tuple(tensors[i * params.num_tensors : (i + 1) * params.num_tensors])
            for i in range(params.num_layers)
        ]
        device = torch.device("cpu")
        whole = PagedKVCache(params, num_ranks * num_blocks, device, layers)
        first = region * num_blocks
        heads = heads_shard.kv_heads(params.num_kv_heads)
        mine = [
            tuple(t[first : first + num_blocks, :, heads.start : heads.stop] for t in kv)
            for kv in layers
        ]
        rank = PagedKVCache(params.for_rank(heads_shard), num_blocks, device, mine)
        return cls(mapped, whole, rank)

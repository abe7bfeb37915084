"""A decode worker's KV pools in one shared-memory segment that same-host senders map.

The receiver creates the segment (a memfd: no name, gone when the receiver is, even one
killed with SIGKILL) and the engine's pools are moved into it (``PagedKVCache.place``). A
same-host sender maps it through /proc by the descriptor the receiver announces for a push
(``SharedFile``), with the push's reserved block runs, and copies
each block once, straight into its destination block; the receiver then checks every
chunk's checksum over the destination before it admits the request. Tensors lie in the
segment in a fixed order (target then draft pool, each layer's K then V, page aligned),
then one fence byte per block, so both ends derive every offset from the layout and the
number of blocks alone. The receiver fences the blocks of a push it refused or dropped:
the sender, which checks them before each chunk, then half-closes the call, and the
receiver reuses the blocks only after that (receiver.py).
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from typing import Protocol

import torch

from kv_transfer.base import KvLayout, KvPool, KvTransferError, RunPair
from kv_transfer.shm_transport import SharedFile, host_id, map_shared
from tandem.v1 import kv_transfer_pb2 as pb

# Initial metadata of a Push whose handshake names shared memory (see receiver.receive).
PLACEMENT_KEY = "tandem-kv-placement"  # "pools": write in place; "ring": use your ring
POOLS_KEY = "tandem-kv-pools-bin"  # ShmSegment: file, size, host_id, num_slots = blocks
BLOCKS_KEY = "tandem-kv-blocks-bin"  # KvChunk whose runs are the reserved blocks
_PAGE = mmap.PAGESIZE

Storage = Callable[[torch.Size, torch.dtype], torch.Tensor]


class Placeable(Protocol):
    """engine.kv_cache.PagedKVCache: pools that can move into storage given by the caller."""

    @property
    def layers(self) -> Sequence[tuple[torch.Tensor, ...]]: ...

    @property
    def is_placeable(self) -> bool: ...  # False: they stay where they are (a split engine's)

    def place(self, storage: Storage) -> None: ...


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _tensors(
    layout: KvLayout, num_blocks: int
) -> Iterator[tuple[KvPool, int, int, tuple[int, ...]]]:
    """(pool, layer, byte offset, shape) of every K and V (or latent) tensor, in segment order."""
    offset = 0
    for pool in KvPool:
        shape = layout.pool_shape(pool)
        if shape is None:
            continue
        dims = (num_blocks, layout.block_size, shape.num_kv_heads, shape.head_dim)
        num_bytes = num_blocks * layout.tensor_block_bytes(pool)
        for layer in range(shape.num_layers):
            for _ in range(shape.num_tensors):
                yield pool, layer, offset, dims
                offset += _round_up(num_bytes, _PAGE)


def _fences_offset(layout: KvLayout, num_blocks: int) -> int:
    """Where the fence bytes start: after the last tensor."""
    *_, (_, _, offset, dims) = _tensors(layout, num_blocks)
    num_bytes = torch.Size(dims).numel() * layout.dtype.itemsize
    return offset + _round_up(num_bytes, _PAGE)


def segment_bytes(layout: KvLayout, num_blocks: int) -> int:
    return _fences_offset(layout, num_blocks) + _round_up(num_blocks, _PAGE)


class SharedKvPools:
    """Every pool of ``layout`` with ``num_blocks`` blocks, in one mapped segment."""

    def __init__(
        self, mm: mmap.mmap, owner_pid: int, file: pb.SharedFd, layout: KvLayout, num_blocks: int
    ) -> None:
        self.size, self.owner_pid, self.file = len(mm), owner_pid, file
        self.layout, self.num_blocks = layout, num_blocks
        self._mm = mm
        data = torch.frombuffer(mm, dtype=torch.uint8)  # [size]
        self._layers: dict[KvPool, list[list[torch.Tensor]]] = {}
        for pool, layer, offset, dims in _tensors(layout, num_blocks):
            num_bytes = torch.Size(dims).numel() * layout.dtype.itemsize
            t = data[offset : offset + num_bytes].view(layout.dtype).view(dims)
            layers = self._layers.setdefault(pool, [])
            if len(layers) == layer:
                layers.append([])
            layers[layer].append(t)
        offset = _fences_offset(layout, num_blocks)
        self._fences = data[offset : offset + num_blocks]  # [num_blocks], 1: fenced
        self._own: SharedFile | None = None  # the receiver's (create)

    @classmethod
    def create(cls, layout: KvLayout, num_blocks: int) -> SharedKvPools:
        """A new zeroed (pre-touched) segment; closed by ``close`` or when collected."""
        file, mm = SharedFile.memory("tandem-kv-pools", segment_bytes(layout, num_blocks))
        pools = cls(mm, os.getpid(), file.describe(), layout, num_blocks)
        pools._own = file
        torch.frombuffer(mm, dtype=torch.uint8).zero_()
        return pools

    @classmethod
    def adopt(cls, layout: KvLayout, pools: Mapping[str, Placeable]) -> SharedKvPools | None:
        """Moves existing CPU pools (e.g. ``LLMEngine.kv_pools``) into a new segment,
        contents kept; None for pools that stay where they are: on a GPU, or split over
        ranks that map them (engine.executor.shared_kv), whose senders use the ring."""
        if any(p.layers[0][0].device.type != "cpu" or not p.is_placeable for p in pools.values()):
            return None
        num_blocks = next(iter(pools.values())).layers[0][0].shape[0]
        shared = cls.create(layout, num_blocks)
        for name, cache in pools.items():
            cache.place(shared.storage(KvPool(name)))
        return shared

    @classmethod
    def attach(cls, segment: pb.ShmSegment, layout: KvLayout) -> SharedKvPools:
        """Maps a receiver's segment (sender side); raises ValueError if it does not fit
        ``layout``."""
        if segment.host_id != host_id():
            raise ValueError(f"host_id: receiver {segment.host_id!r}, this host {host_id()!r}")
        if segment.num_slots < 1 or segment.size != segment_bytes(layout, segment.num_slots):
            raise ValueError(f"size: {segment.size} bytes do not hold {segment.num_slots} blocks")
        mm = map_shared(segment.owner_pid, segment.file, segment.size)
        return cls(mm, segment.owner_pid, segment.file, layout, segment.num_slots)

    def segment(self) -> pb.ShmSegment:
        return pb.ShmSegment(
            size=self.size,
            host_id=host_id(),
            num_slots=self.num_blocks,
            owner_pid=self.owner_pid,
            file=self.file,
        )

    def layer(self, pool: KvPool, layer: int) -> tuple[torch.Tensor, ...]:
        return tuple(self._layers[pool][layer])

    def storage(self, pool: KvPool) -> Storage:
        """Hands out ``pool``'s tensors in order: K then V (or the latent) of each layer."""
        tensors = iter([t for kv in self._layers[pool] for t in kv])

        def take(shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
            t = next(tensors)
            if t.shape != shape or t.dtype != dtype:
                raise ValueError(
                    f"{pool} pool: {dtype} {tuple(shape)}, segment has {t.dtype} {tuple(t.shape)}"
                )
            return t

        return take

    def holds(self, pool: KvPool, layers: Sequence[tuple[torch.Tensor, ...]]) -> bool:
        """Whether ``layers`` are this segment's tensors of ``pool`` (what a sender writes)."""
        mine = self._layers.get(pool)
        if mine is None or len(mine) != len(layers):
            return False
        return all(
            t.data_ptr() == m.data_ptr() and t.shape == m.shape
            for kv, mkv in zip(layers, mine, strict=True)
            for t, m in zip(kv, mkv, strict=True)
        )

    def fence(self, block_ids: Sequence[int], *, is_fenced: bool = True) -> None:
        """Marks blocks whose push was refused or dropped (False: clears the marks), so
        that the sender writing them stops before its next chunk."""
        self._fences[torch.as_tensor(list(block_ids), dtype=torch.int64)] = int(is_fenced)

    def is_fenced(self, first_block_id: int, num_blocks: int) -> bool:
        """Whether any of the run's blocks is fenced."""
        return bool(self._fences[first_block_id : first_block_id + num_blocks].any())

    def is_open(self) -> bool:
        """Whether the receiver still holds this segment (sender side)."""
        return SharedFile.is_open(self.owner_pid, self.file)

    def close(self) -> None:
        """Closes the segment's file (receiver side); the memory goes with the last
        mapping, senders' included."""
        if self._own is not None:
            self._own.close()


class PoolDestination:
    """A mapped receiver segment as a sender's ``Destination``: writes only the blocks the
    receiver announced as reserved for this push, only while the push is live, and not
    once the receiver fenced them (then ``stop`` ends the call from this side)."""

    def __init__(
        self,
        pools: SharedKvPools,
        reserved: Sequence[RunPair],
        is_live: Callable[[], bool],
        failure: Callable[[], Awaitable[KvTransferError]],
        stop: Callable[[], Awaitable[KvTransferError]],
    ) -> None:
        self.pools = pools
        self._reserved = {r.dst_start + i for r in reserved for i in range(r.num_blocks)}
        self._is_live = is_live
        self._failure = failure
        self._stop = stop

    def layer(self, pool: KvPool, layer: int) -> tuple[torch.Tensor, ...]:
        return self.pools.layer(pool, layer)

    async def check(self, pool: KvPool, layer: int, runs: Sequence[RunPair]) -> None:
        if not self._is_live():
            raise await self._failure()
        for run in runs:
            for block in range(run.dst_start, run.dst_start + run.num_blocks):
                if block not in self._reserved:
                    raise KvTransferError(
                        pb.KV_PUSH_STATUS_INVALID_CHUNK,
                        f"runs: block {block} is outside the reservation",
                    )
        if any(self.pools.is_fenced(run.dst_start, run.num_blocks) for run in runs):
            raise await self._stop()  # the receiver waits for this end to reuse the blocks


def reserved_runs(block_ids: Sequence[int]) -> list[RunPair]:
    """The reservation as runs of consecutive ids (what BLOCKS_KEY carries)."""
    runs: list[RunPair] = []
    for block in block_ids:
        if runs and runs[-1].dst_start + runs[-1].num_blocks == block:
            last = runs[-1]
            runs[-1] = RunPair(last.src_start, last.dst_start, last.num_blocks + 1)
        else:
            runs.append(RunPair(block, block, 1))
    return runs

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

**Pools on a GPU** (CUDA IPC; never run on a GPU). The tensors lie in one
device allocation, in the same order, exported as a CUDA IPC handle (cuda_ipc.py); the
segment holds the fence bytes alone. The receiver answers a same-host push with placement
"cuda_ipc": the handle too (``IPC_KEY``). The sender opens it and copies each block device
to device; both ends checksum the blocks where they lie, with CHECKSUM_KIND_SUM64 (the
receiver offers the GPU pools only to a push that chose it and names their GPU:
``ReceiveSession``). Where the runtime refuses CUDA IPC, ``adopt`` leaves the pools where
they are and senders use the ring.
"""

from __future__ import annotations

import logging
import mmap
import os
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from typing import Protocol

import torch

from kv_transfer import cuda_ipc
from kv_transfer.base import KvLayout, KvPool, KvTransferError, RunPair
from kv_transfer.shm_transport import SharedFile, host_id, map_shared
from tandem.v1 import kv_transfer_pb2 as pb

logger = logging.getLogger(__name__)

# Initial metadata of a Push whose handshake names shared memory (see receiver.receive).
# "pools": write in place; "cuda_ipc": in place, on a GPU (IPC_KEY); "ring": use your ring
PLACEMENT_KEY = "tandem-kv-placement"
POOLS_KEY = "tandem-kv-pools-bin"  # ShmSegment: file, size, host_id, num_slots = blocks
BLOCKS_KEY = "tandem-kv-blocks-bin"  # KvChunk whose runs are the reserved blocks
IPC_KEY = "tandem-kv-cuda-ipc-bin"  # cuda_ipc.IpcHandle: the GPU pools (POOLS_KEY: fences)
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
    """Every pool of ``layout`` with ``num_blocks`` blocks, in one mapped segment (or, on a
    GPU, in ``device_bytes``, the segment holding the fences alone)."""

    def __init__(
        self,
        mm: mmap.mmap,
        owner_pid: int,
        file: pb.SharedFd,
        layout: KvLayout,
        num_blocks: int,
        device_bytes: torch.Tensor | None = None,
    ) -> None:
        self.size, self.owner_pid, self.file = len(mm), owner_pid, file
        self.layout, self.num_blocks = layout, num_blocks
        self._mm = mm
        host = torch.frombuffer(mm, dtype=torch.uint8)  # [size]
        data = host if device_bytes is None else device_bytes
        self.device = data.device
        # On a GPU: the receiver's exported handle, or the one a sender opened.
        self.ipc: cuda_ipc.IpcHandle | None = None
        self._opened: cuda_ipc.OpenedTensor | None = None
        self.users = 0  # a sender's pushes writing into these pools now
        self._dropped = False  # out of the sender's cache: unmapped once unused
        self._layers: dict[KvPool, list[list[torch.Tensor]]] = {}
        for pool, layer, offset, dims in _tensors(layout, num_blocks):
            num_bytes = torch.Size(dims).numel() * layout.dtype.itemsize
            t = data[offset : offset + num_bytes].view(layout.dtype).view(dims)
            layers = self._layers.setdefault(pool, [])
            if len(layers) == layer:
                layers.append([])
            layers[layer].append(t)
        offset = _fences_offset(layout, num_blocks) if device_bytes is None else 0
        self._fences = host[offset : offset + num_blocks]  # [num_blocks], 1: fenced
        self._own: SharedFile | None = None  # the receiver's (create)

    @classmethod
    def create(
        cls, layout: KvLayout, num_blocks: int, device: torch.device | None = None
    ) -> SharedKvPools:
        """A new zeroed (pre-touched) segment; closed by ``close`` or when collected. On a
        CUDA ``device``: the pools in one exported allocation there (raises
        ``cuda_ipc.CudaIpcUnavailable`` where the runtime refuses)."""
        if device is None or device.type == "cpu":
            file, mm = SharedFile.memory("tandem-kv-pools", segment_bytes(layout, num_blocks))
            pools = cls(mm, os.getpid(), file.describe(), layout, num_blocks)
            torch.frombuffer(mm, dtype=torch.uint8).zero_()
        else:
            tensor_bytes = _fences_offset(layout, num_blocks)
            data = torch.zeros(tensor_bytes, dtype=torch.uint8, device=device)
            handle = cuda_ipc.export(data)
            file, mm = SharedFile.memory("tandem-kv-fences", _round_up(num_blocks, _PAGE))
            pools = cls(mm, os.getpid(), file.describe(), layout, num_blocks, data)
            pools.ipc = handle
        pools._own = file
        return pools

    @staticmethod
    def refusal(device: torch.device) -> str | None:
        """Why pools on ``device`` cannot move into shared memory, or None: a GPU whose
        runtime refuses CUDA IPC (asked by exporting a byte), or a device of another kind.
        For a caller that must undo something before ``adopt`` (``share_pools``' graphs)."""
        if device.type == "cuda":
            return cuda_ipc.export_refusal(device)
        return None if device.type == "cpu" else f"pools on {device} are not shared"

    @classmethod
    def adopt(cls, layout: KvLayout, pools: Mapping[str, Placeable]) -> SharedKvPools | None:
        """Moves existing pools (e.g. ``LLMEngine.kv_pools``) into a new segment (on a GPU,
        an exported allocation), contents kept; None for pools that stay where they are:
        split over ranks that map them (engine.executor.shared_kv), or on a GPU whose
        runtime refuses CUDA IPC. Their same-host senders use the ring."""
        devices = {p.layers[0][0].device for p in pools.values()}
        if len(devices) != 1 or any(not p.is_placeable for p in pools.values()):
            return None
        (device,) = devices
        if device.type not in ("cpu", "cuda"):  # a refused GPU: create raises, below
            return None
        num_blocks = next(iter(pools.values())).layers[0][0].shape[0]
        try:  # on a GPU the pools are copied over: their memory twice, for a moment
            shared = cls.create(layout, num_blocks, device)
        except (cuda_ipc.CudaIpcUnavailable, torch.cuda.OutOfMemoryError) as e:
            logger.warning("KV pools stay unshared (same-host pushes use the ring): %s", e)
            return None
        for name, cache in pools.items():
            cache.place(shared.storage(KvPool(name)))
        return shared

    @classmethod
    def attach(
        cls, segment: pb.ShmSegment, layout: KvLayout, ipc: bytes | None = None
    ) -> SharedKvPools:
        """Maps a receiver's segment (sender side), and with ``ipc`` opens its GPU pools;
        raises ValueError if they do not fit ``layout``, ``cuda_ipc.CudaIpcUnavailable``
        where the GPU pools cannot be opened here."""
        if segment.host_id != host_id():
            raise ValueError(f"host_id: receiver {segment.host_id!r}, this host {host_id()!r}")
        blocks = segment.num_slots
        if ipc is None:
            if blocks < 1 or segment.size != segment_bytes(layout, blocks):
                raise ValueError(f"size: {segment.size} bytes do not hold {blocks} blocks")
            mm = map_shared(segment.owner_pid, segment.file, segment.size)
            return cls(mm, segment.owner_pid, segment.file, layout, blocks)
        handle = cuda_ipc.IpcHandle.from_bytes(ipc)
        if blocks < 1 or segment.size != _round_up(blocks, _PAGE):
            raise ValueError(f"size: {segment.size} bytes are not {blocks} blocks' fences")
        if handle.num_bytes != _fences_offset(layout, blocks):
            raise ValueError(f"cuda_ipc: {handle.num_bytes} bytes do not hold {blocks} blocks")
        mm = map_shared(segment.owner_pid, segment.file, segment.size)
        opened = cuda_ipc.OpenedTensor(handle)
        pools = cls(mm, segment.owner_pid, segment.file, layout, blocks, opened.bytes)
        pools.ipc, pools._opened = handle, opened
        return pools

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

    def use(self) -> None:
        """A push starts writing here (sender side)."""
        self.users += 1

    def unuse(self) -> None:
        """A push stopped writing here: a dropped mapping's GPU handle closes once unused."""
        self.users -= 1
        if self._dropped and self.users == 0:
            self._unmap()

    def drop(self) -> None:
        """Out of a sender's cache (its receiver gone, or others used since): its GPU
        handle is closed once no push writes through it."""
        self._dropped = True
        if self.users == 0:
            self._unmap()

    def _unmap(self) -> None:
        if self._opened is not None:
            opened, self._opened = self._opened, None
            try:
                opened.close()
            except cuda_ipc.CudaIpcUnavailable as e:  # a gone receiver's: nothing to save
                logger.warning("closing a receiver's GPU pools: %s", e)

    def close(self) -> None:
        """Closes the segment's file (receiver side); the memory goes with the last
        mapping, senders' included. A sender's opened GPU pools are unmapped."""
        if self._own is not None:
            self._own.close()
        self._unmap()


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

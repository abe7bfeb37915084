"""One push into one reservation: the reservation, every check, then the writes.

A chunk's blocks must be reserved for the request and not written yet for its layers; its
data is copied into the pools while it is checksummed (gRPC, ring), or, for a same-host
sender that wrote the blocks in place (shared pools), the blocks are checksummed where they
lie. Nothing is admitted before every block of every layer arrived and checked.
"""

from __future__ import annotations

import asyncio
import math
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn, Protocol

import torch

from kv_transfer.base import (
    POOL_FROM_WIRE,
    KvLayout,
    KvPool,
    KvTransferError,
    PagedPools,
    TransferState,
    dtype_name,
)
from kv_transfer.checksum import (
    ChecksumFn,
    Sum64,
    checksum_function,
    kind_name,
    running_checksum,
)
from kv_transfer.copying import PIECE_BYTES, byte_view, unpack_runs
from kv_transfer.shared_pools import SharedKvPools
from kv_transfer.shm_transport import host_id
from tandem.v1 import kv_transfer_pb2 as pb

EXTRA_DTYPES: dict[str, torch.dtype] = {
    dtype_name(d): d
    for d in (
        *(torch.float32, torch.float16, torch.bfloat16, torch.float64),
        *(torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool),
    )
}
MAX_EXTRA_DIMS = 8


class ChunkSource(Protocol):
    """Chunks that travel outside the message stream (the shared-memory ring), in order."""

    def next_chunk(self) -> tuple[pb.KvChunk, memoryview] | None:
        """The next published chunk (its header, and its data in place), or None for now.
        Raises ValueError on a chunk that cannot be read."""

    def consumed(self) -> None:
        """The chunk from the last ``next_chunk`` was copied out: its space may be reused."""

    async def wait(self, until: asyncio.Future[Any]) -> None:
        """Returns once a chunk may have been published, or once ``until`` is done."""

    def close(self) -> None:
        """The push ended: stop watching (idempotent)."""


SegmentAttacher = Callable[[pb.ShmSegment], ChunkSource]  # raises ValueError / OSError


@dataclass(frozen=True)
class KvReservation:
    """Blocks a decode worker reserved for one request; every layer of every pool in
    ``layout`` must arrive for each of ``block_ids``."""

    request_id: str
    block_ids: Sequence[int]  # destination ids to fill (blocks of cached prefix excluded)
    # "target" and, with a draft, "draft" (KvPool values), e.g. LLMEngine.kv_pools
    pools: Mapping[str, PagedPools]
    layout: KvLayout  # what the receiver expects (its own pools' layout)
    # The LoRA adapter the request runs under here, and its digest; "": the base model.
    # A push of KV computed under another (or other files under the name) is refused.
    lora: str = ""
    lora_digest: str = ""

    def __post_init__(self) -> None:
        if len(set(self.block_ids)) != len(self.block_ids):
            raise ValueError(f"block_ids: duplicates in {list(self.block_ids)}")
        for pool in KvPool:
            shape = self.layout.pool_shape(pool)
            if (shape is None) != (pool not in self.pools):
                raise ValueError(f"pools: {pool} pool given without its layout, or the reverse")
            if shape is None:
                continue
            layers = self.pools[pool].layers
            k = layers[0][0]
            num_blocks = k.shape[0]
            expected = (self.layout.block_size, shape.num_kv_heads, shape.head_dim)
            if len(layers) != shape.num_layers or tuple(k.shape[1:]) != expected:
                raise ValueError(
                    f"pools: {pool} has {len(layers)} layers of {tuple(k.shape)}, "
                    f"layout says {shape.num_layers} of [num_blocks, {expected}]"
                )
            if len(layers[0]) != shape.num_tensors:
                raise ValueError(
                    f"pools: {pool} has {len(layers[0])} pools per layer, layout says "
                    f"{shape.num_tensors}"
                )
            if k.dtype != self.layout.dtype:
                raise ValueError(f"pools: {pool} holds {k.dtype}, layout {self.layout.dtype}")
            if any(not 0 <= b < num_blocks for b in self.block_ids):
                raise ValueError(f"block_ids: outside 0..{num_blocks - 1} of the {pool} pool")


_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """A stream of ``device``'s own for checksumming placed blocks, made once."""
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return _SIDE_STREAMS[device]


class InPlaceWriter:
    """A same-host sender that may be writing a reservation's blocks in place (shared
    pools): they must not go to another request before ``stopped`` is done, once it has
    provably stopped writing (it half-closed, or a grace period after its call ended)."""

    def __init__(self, pools: SharedKvPools, block_ids: Sequence[int]) -> None:
        self._pools, self._block_ids = pools, block_ids
        self.stopped: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._is_fenced = False

    def fence(self) -> None:
        """Marks the blocks: the sender's check before its next chunk stops it."""
        if not self._is_fenced and not self.stopped.done():
            self._pools.fence(self._block_ids)
            self._is_fenced = True

    def has_stopped(self) -> None:
        """Nothing writes the blocks any more: they may be reused (idempotent)."""
        if not self.stopped.done():
            if self._is_fenced:
                self._pools.fence(self._block_ids, is_fenced=False)
            self.stopped.set_result(None)

    def stops_after(self, grace_s: float) -> None:
        """The call ended without the sender's half-close (cancelled, timed out, ended by
        the receiver): a copy in flight may still land, for at most ``grace_s``."""
        self.fence()
        asyncio.get_running_loop().call_later(grace_s, self.has_stopped)


@dataclass(eq=False)
class TransferRecord:
    """One reservation's transfer as the receiver tracks it: state, outcome, extra tensors."""

    reservation: KvReservation
    state: TransferState = TransferState.RESERVED
    message: str = ""
    status: int = pb.KV_PUSH_STATUS_UNSPECIFIED
    extra: dict[str, torch.Tensor] = field(default_factory=dict)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    is_dropped: bool = False
    writer: InPlaceWriter | None = None  # set once a same-host sender is told to write in place
    epoch: int | None = None  # the receiver's epoch when it was reserved

    def end(self, state: TransferState, status: int, message: str = "") -> None:
        if self.state in (TransferState.RESERVED, TransferState.TRANSFERRING):
            self.state, self.status, self.message = state, status, message
            self.done.set()


def _nothing() -> None:
    pass


class ReceiveSession:
    """One push into one reservation: every check, then the writes."""

    def __init__(self, record: TransferRecord) -> None:
        self._record = record
        self._layout = record.reservation.layout
        self._checksum: ChecksumFn = zlib.crc32  # set by check_handshake
        self._checksum_kind: int = pb.CHECKSUM_KIND_CRC32
        self.source: ChunkSource | None = None  # the ring of a shared-memory push
        self.placement: SharedKvPools | None = None  # the pools a same-host sender writes
        self.is_placed = False  # blocks arrive written in place (shared pools, loopback)
        self._byte_views: dict[tuple[KvPool, int], tuple[memoryview | None, ...]] = {}
        self._next_sequence = 0
        block_ids = record.reservation.block_ids
        self._index = {block: i for i, block in enumerate(block_ids)}
        # _run_end[i]: end of the consecutive block ids from reservation index i
        self._run_end = list(range(1, len(block_ids) + 1))
        for i in reversed(range(len(block_ids) - 1)):
            if block_ids[i + 1] == block_ids[i] + 1:
                self._run_end[i] = self._run_end[i + 1]
        self._written = {  # per layer, per reservation index: 1 once that block arrived
            pool: [bytearray(len(block_ids)) for _ in range(shape.num_layers)]
            for pool in KvPool
            if (shape := self._layout.pool_shape(pool)) is not None
        }
        self.is_finished = False
        self.num_bytes = 0
        self.num_chunks = 0
        self.on_progress: Callable[[], None] = _nothing  # after each chunk taken

    @property
    def block_ids(self) -> Sequence[int]:
        return self._record.reservation.block_ids

    @property
    def pools(self) -> Mapping[str, PagedPools]:
        return self._record.reservation.pools

    @property
    def writer(self) -> InPlaceWriter | None:
        return self._record.writer

    async def ended(self) -> None:
        """Until the request is done, failed or dropped."""
        await self._record.done.wait()

    def check_handshake(
        self, hs: pb.KvHandshake, attach: SegmentAttacher | None, shared: SharedKvPools | None
    ) -> None:
        """Checks the sender's layout and checksum; a same-host handshake is answered with
        the shared pools when the reservation lies in them, else its ring is attached."""
        checksum = checksum_function(hs.checksum_kind)
        if checksum is None:
            self._refuse_incompatible(f"checksum_kind: {kind_name(hs.checksum_kind)} unavailable")
        self._checksum, self._checksum_kind = checksum, hs.checksum_kind
        try:
            sender = KvLayout.from_handshake(hs)
        except ValueError as e:
            self._refuse_incompatible(str(e))
        mismatch = self._layout.mismatch(sender)
        if mismatch is not None:
            self._refuse_incompatible(mismatch)
        reserved = self._record.reservation
        if (hs.lora, hs.lora_digest) != (reserved.lora, reserved.lora_digest):
            self._refuse_incompatible(
                f"lora: sender computed the KV under {hs.lora or 'the base model'!r} "
                f"(digest {hs.lora_digest!r}), the reservation is under "
                f"{reserved.lora or 'the base model'!r} (digest {reserved.lora_digest!r})"
            )
        if hs.HasField("shm"):
            # GPU pools: only for a sender that sees their GPU and checksums where the blocks
            # lie (SUM64); others, the ring.
            ipc = shared.ipc if shared is not None else None
            if ipc is not None and (
                hs.checksum_kind != pb.CHECKSUM_KIND_SUM64
                or ipc.bus_id.decode() not in hs.cuda_ipc_bus_ids
            ):
                shared = None
            if shared is not None and self._in_shared(shared, hs.shm.host_id):
                self.placement, self.is_placed = shared, True
                self._record.writer = InPlaceWriter(shared, self.block_ids)
                return
            if attach is None:
                self._refuse_incompatible("shm: shared memory is not enabled on this receiver")
            try:
                self.source = attach(hs.shm)
            except (ValueError, OSError) as e:
                self._refuse_incompatible(f"shm: {e}")

    def on_chunk(self, chunk: pb.KvChunk, data: memoryview) -> None:
        """Checks one chunk's header, then writes its data while checksumming it (or, for a
        push into shared pools, checksums the blocks the sender wrote): a refused chunk marks
        nothing written, though a corrupted one may have overwritten its (still unwritten,
        reserved) blocks. ``data`` is the chunk's data field (split off by
        wire.split_push_message) or its data in the ring."""
        self.check_live()
        if chunk.sequence_number != self._next_sequence:
            what = "repeat" if chunk.sequence_number < self._next_sequence else "gap"
            raise KvTransferError(
                pb.KV_PUSH_STATUS_OUT_OF_ORDER,
                f"sequence_number: {what}, got {chunk.sequence_number}, "
                f"expected {self._next_sequence}",
            )
        self._next_sequence += 1
        if chunk.extra_tensors and not chunk.is_last:
            self._invalid("extra_tensors: only on the last message")
        if chunk.runs:
            self._on_data(chunk, data)
        elif data or not chunk.is_last:
            self._invalid("runs: a chunk with data names no block runs")
        self.num_chunks += 1
        if chunk.is_last:
            extra = {t.name: self._decode_extra(t) for t in chunk.extra_tensors}
            if len(extra) != len(chunk.extra_tensors):
                self._invalid("extra_tensors: repeated names")
            self._complete(extra)
        self.on_progress()

    def check_runs(
        self, pool: KvPool, layer_start: int, layer_end: int, runs: Sequence[tuple[int, int]]
    ) -> list[tuple[int, int]]:
        """The runs' blocks as ranges of reservation indices, after checking pool, layers,
        and that every block is reserved and not written yet for these layers."""
        self.check_live()
        written = self._written.get(pool)
        if written is None:
            self._invalid(f"pool: the request has no {pool} KV")
        if not 0 <= layer_start < layer_end <= len(written):
            self._invalid(f"layers: [{layer_start}, {layer_end}) not in [0, {len(written)})")
        if len(runs) > len(self._index):
            self._invalid(f"runs: {len(runs)} runs for {len(self._index)} reserved blocks")
        ranges = []
        for first, num_blocks in runs:
            if num_blocks < 1:
                self._invalid(f"runs: empty run at block {first}")
            start = self._index.get(first)
            if start is not None and self._run_end[start] >= start + num_blocks:
                ranges.append((start, start + num_blocks))  # reserved as a run too
                continue
            for block in range(first, first + num_blocks):
                if block not in self._index:
                    self._invalid(f"runs: block {block} is outside the reservation")
                ranges.append((self._index[block], self._index[block] + 1))
        for layer in range(layer_start, layer_end):
            for a, b in ranges:
                if (i := written[layer].find(1, a, b)) >= 0:
                    block = self._record.reservation.block_ids[i]
                    self._invalid(f"runs: {pool} layer {layer} block {block} repeated")
        return ranges

    def _mark_written(
        self, pool: KvPool, layer_start: int, layer_end: int, ranges: list[tuple[int, int]]
    ) -> None:
        for row in self._written[pool][layer_start:layer_end]:
            for a, b in ranges:
                row[a:b] = b"\x01" * (b - a)

    def fail(self, status: int, message: str) -> None:
        self._record.end(TransferState.FAILED, status, message)

    def reply(self, status: int, message: str) -> pb.KvPushReply:
        return pb.KvPushReply(
            status=status,  # type: ignore[arg-type]
            num_bytes_received=self.num_bytes,
            num_chunks_received=self.num_chunks,
            message=message,
        )

    def _on_data(self, chunk: pb.KvChunk, data: memoryview) -> None:
        pool = POOL_FROM_WIRE.get(chunk.pool)
        if pool is None:
            self._invalid(f"pool: {chunk.pool} is not a pool")
        if chunk.dtype != dtype_name(self._layout.dtype):
            self._invalid(f"dtype: chunk has {chunk.dtype!r}, handshake {self._layout.dtype}")
        runs = [(r.first_block_id, r.num_blocks) for r in chunk.runs]
        ranges = self.check_runs(pool, chunk.layer_start, chunk.layer_end, runs)
        num_blocks = sum(b - a for a, b in ranges)
        expected = (
            (chunk.layer_end - chunk.layer_start) * num_blocks * self._layout.block_bytes(pool)
        )
        if self.is_placed:
            if data:
                self._invalid("data: a push into shared pools sends chunk headers only")
            checksum = self._checksum_placed(pool, chunk.layer_start, chunk.layer_end, runs)
        else:
            if len(data) != expected:
                self._invalid(
                    f"data: {len(data)} bytes, expected {expected} for these layers and runs"
                )
            checksum = self._write(pool, chunk.layer_start, chunk.layer_end, runs, data)
        if checksum != chunk.checksum:
            raise KvTransferError(
                pb.KV_PUSH_STATUS_CHECKSUM_MISMATCH,
                f"chunk {chunk.sequence_number}: checksum differs from its data",
            )
        self._mark_written(pool, chunk.layer_start, chunk.layer_end, ranges)
        self.num_bytes += expected

    def _write(
        self,
        pool: KvPool,
        layer_start: int,
        layer_end: int,
        runs: list[tuple[int, int]],
        data: memoryview,
    ) -> int:
        """Copies the chunk's data into the pools; returns its checksum (taken piece by
        piece just before each piece is copied, while it is in cache)."""
        running = running_checksum(self._checksum_kind)
        layers = self._record.reservation.pools[pool].layers
        offset = 0
        for layer in range(layer_start, layer_end):
            offset += unpack_runs(layers[layer], runs, data[offset:], running)
        return running.intdigest()

    def _checksum_placed(
        self, pool: KvPool, layer_start: int, layer_end: int, runs: list[tuple[int, int]]
    ) -> int:
        """The checksum of blocks a sender wrote in place, read in the order it packed them
        (layer, run, K then V): what it sent must be what the pools now hold."""
        running = running_checksum(self._checksum_kind)
        block_bytes = self._layout.tensor_block_bytes(pool)  # K (or V) of one block
        if self.placement is not None and self.placement.ipc is not None:  # on a GPU
            assert isinstance(running, Sum64), "GPU pools are placed under SUM64 only"
            # On a stream of its own: not behind the decode steps queued on the default
            # one (the sender's copies landed before it sent the header).
            with torch.cuda.stream(_side_stream(self.placement.device)):
                for layer in range(layer_start, layer_end):
                    kv = self._record.reservation.pools[pool].layers[layer]
                    for first, num_blocks in runs:
                        for t in kv:
                            running.update_tensor(t[first : first + num_blocks])
                return running.intdigest()
        for layer in range(layer_start, layer_end):
            views = self._pool_bytes(pool, layer)
            for first, num_blocks in runs:
                start, end = first * block_bytes, (first + num_blocks) * block_bytes
                for dst in views:
                    assert dst is not None, "shared pools are CPU memory"
                    for piece in range(start, end, PIECE_BYTES):
                        running.update(dst[piece : min(piece + PIECE_BYTES, end)])
        return running.intdigest()

    def _in_shared(self, shared: SharedKvPools, sender_host: str) -> bool:
        """Whether a sender on ``sender_host`` can write this reservation's pools in place."""
        if sender_host != host_id():
            return False
        pools = self._record.reservation.pools
        return all(
            shared.holds(pool, pools[pool].layers)
            for pool in KvPool
            if self._layout.pool_shape(pool) is not None
        )

    def _pool_bytes(self, pool: KvPool, layer: int) -> tuple[memoryview | None, ...]:
        """K and V of a destination layer as bytes (None: not CPU memory), made once."""
        views = self._byte_views.get((pool, layer))
        if views is None:
            kv = self._record.reservation.pools[pool].layers[layer]
            views = self._byte_views[pool, layer] = tuple(byte_view(t) for t in kv)
        return views

    def _decode_extra(self, t: pb.NamedTensor) -> torch.Tensor:
        dtype = EXTRA_DTYPES.get(t.dtype)
        if dtype is None:
            self._invalid(f"extra_tensors: {t.name!r} has dtype {t.dtype!r}")
        shape = list(t.shape)
        data = t.data
        if len(shape) > MAX_EXTRA_DIMS or math.prod(shape) * dtype.itemsize != len(data):
            self._invalid(f"extra_tensors: {t.name!r} shape {shape} does not fit {len(data)} bytes")
        if self._checksum(data) != t.checksum:
            raise KvTransferError(
                pb.KV_PUSH_STATUS_CHECKSUM_MISMATCH, f"extra_tensors: {t.name!r} checksum differs"
            )
        if not data:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(bytearray(data), dtype=dtype).reshape(shape)

    def written_in_place(self) -> None:
        """The receiver's own engine computed every reserved block (an in-process
        channel, ``in_place.py``): done, with nothing sent or checked."""
        self.check_live()
        for written in self._written.values():
            for row in written:
                row[:] = b"\x01" * len(row)
        self._complete({})

    def _complete(self, extra: dict[str, torch.Tensor]) -> None:
        for pool, written in self._written.items():
            for layer, row in enumerate(written):
                if (i := row.find(0)) < 0:
                    continue
                block = self._record.reservation.block_ids[i]
                raise KvTransferError(
                    pb.KV_PUSH_STATUS_INCOMPLETE,
                    f"{pool} layer {layer} block {block} never arrived",
                )
        self._record.extra = extra
        self._record.end(TransferState.DONE, pb.KV_PUSH_STATUS_OK)
        self.is_finished = True

    def check_live(self) -> None:
        if self._record.is_dropped:
            raise KvTransferError(pb.KV_PUSH_STATUS_UNKNOWN_REQUEST, "the reservation was dropped")
        if self.is_finished:
            raise KvTransferError(pb.KV_PUSH_STATUS_OUT_OF_ORDER, "data after is_last")
        if self._record.state is not TransferState.TRANSFERRING:
            raise KvTransferError(self._record.status, self._record.message)

    def _invalid(self, message: str) -> NoReturn:
        raise KvTransferError(pb.KV_PUSH_STATUS_INVALID_CHUNK, message)

    def _refuse_incompatible(self, message: str) -> NoReturn:
        raise KvTransferError(pb.KV_PUSH_STATUS_INCOMPATIBLE, message)

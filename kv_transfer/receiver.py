"""The receiving side of every transport: reservations, checks, writes into the pools.

A decode worker ``reserve``s a request's destination blocks, the transport feeds the push
(``receive`` for a KvPushMessage stream, with chunks from a shared-memory ring when the
handshake names one; a ``ReceiveSession`` for direct copies), and the worker awaits
``wait_done``. Anything wrong (checksum, layout, block outside the reservation, sequence gap
or repeat, missing KV) fails the request with a message.
"""

from __future__ import annotations

import asyncio
import math
import zlib
from collections.abc import (
    AsyncGenerator,
    AsyncIterable,
    AsyncIterator,
    Callable,
    Mapping,
    Sequence,
)
from dataclasses import dataclass, field
from typing import Any, NoReturn, Protocol

import torch

from kv_transfer.base import (
    POOL_FROM_WIRE,
    KvLayout,
    KvPool,
    KvTransferError,
    PagedPools,
    RunPair,
    TransferState,
    dtype_name,
)
from kv_transfer.checksum import (
    ChecksumFn,
    checksum_function,
    kind_name,
    running_checksum,
)
from kv_transfer.copying import byte_view, hash_then_copy, unpack
from kv_transfer.wire import split_push_message
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
            if k.dtype != self.layout.dtype:
                raise ValueError(f"pools: {pool} holds {k.dtype}, layout {self.layout.dtype}")
            if any(not 0 <= b < num_blocks for b in self.block_ids):
                raise ValueError(f"block_ids: outside 0..{num_blocks - 1} of the {pool} pool")


@dataclass(eq=False)
class _Record:
    reservation: KvReservation
    state: TransferState = TransferState.RESERVED
    message: str = ""
    status: int = pb.KV_PUSH_STATUS_UNSPECIFIED
    extra: dict[str, torch.Tensor] = field(default_factory=dict)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    is_released: bool = False

    def end(self, state: TransferState, status: int, message: str = "") -> None:
        if self.state in (TransferState.RESERVED, TransferState.TRANSFERRING):
            self.state, self.status, self.message = state, status, message
            self.done.set()


class KvReceiver:
    """Reservations by request id, checked and written by whatever transport delivers.
    Not thread-safe: use it from the event loop that serves the pushes."""

    def __init__(
        self, *, epoch: int | None = None, attach_segment: SegmentAttacher | None = None
    ) -> None:
        self.epoch = epoch  # None: decode_epoch is not checked
        self._attach_segment = attach_segment  # None: shared-memory pushes are refused
        self._records: dict[str, _Record] = {}

    def reserve(self, reservation: KvReservation) -> None:
        if reservation.request_id in self._records:
            raise ValueError(f"request_id: {reservation.request_id!r} is already reserved")
        self._records[reservation.request_id] = _Record(reservation)

    def state(self, request_id: str) -> TransferState | None:
        record = self._records.get(request_id)
        return record.state if record else None

    def failure(self, request_id: str) -> str:
        record = self._records.get(request_id)
        return record.message if record else ""

    async def wait_done(self, request_id: str, timeout: float) -> dict[str, torch.Tensor]:
        """The extra tensors once every block arrived; raises KvTransferError when the
        transfer failed, TimeoutError after ``timeout`` seconds, KeyError if not reserved."""
        record = self._records[request_id]
        await asyncio.wait_for(record.done.wait(), timeout)
        if record.state is TransferState.FAILED:
            raise KvTransferError(record.status, record.message)
        return record.extra

    def release(self, request_id: str) -> None:
        """Forgets the request (done, failed or aborted); a push still running is refused
        before its next write, so its blocks can be given to another request."""
        record = self._records.pop(request_id, None)
        if record is not None:
            record.is_released = True
            record.end(TransferState.FAILED, pb.KV_PUSH_STATUS_UNKNOWN_REQUEST, "released")

    def open(self, handshake: pb.KvHandshake) -> ReceiveSession:
        """Starts a push; raises KvTransferError (failing the request where it has one)."""
        record = self._records.get(handshake.request_id)
        if record is None:
            raise KvTransferError(
                pb.KV_PUSH_STATUS_UNKNOWN_REQUEST,
                f"request {handshake.request_id!r} has no reservation here",
            )
        if self.epoch is not None and handshake.decode_epoch != self.epoch:
            raise KvTransferError(
                pb.KV_PUSH_STATUS_STALE_EPOCH,
                f"decode_epoch: sender has {handshake.decode_epoch}, receiver is {self.epoch}",
            )
        if record.state is not TransferState.RESERVED:
            raise KvTransferError(
                pb.KV_PUSH_STATUS_OUT_OF_ORDER,
                f"request {handshake.request_id!r} is already {record.state.value}",
            )
        record.state = TransferState.TRANSFERRING
        session = ReceiveSession(record)
        try:
            session.check_handshake(handshake, self._attach_segment)
        except KvTransferError as e:
            session.fail(e.status, e.message)
            raise
        return session

    async def receive(self, raw_messages: AsyncIterable[bytes]) -> pb.KvPushReply:
        """Consumes one Push stream of serialized KvPushMessages; the reply says OK or why
        it was refused. Chunk data is checked and written from the received bytes."""
        session: ReceiveSession | None = None
        ring_stream: AsyncGenerator[bytes, None] | None = None
        iterator = aiter(raw_messages)
        try:
            first = await anext(iterator, None)
            if first is None:
                raise KvTransferError(pb.KV_PUSH_STATUS_INCOMPLETE, "no handshake")
            message, _ = _split(first)
            if message.WhichOneof("kind") != "handshake":
                raise KvTransferError(
                    pb.KV_PUSH_STATUS_OUT_OF_ORDER, "a chunk before the handshake"
                )
            session = self.open(message.handshake)
            source = session.source
            stream: AsyncIterator[bytes] = iterator
            if source is not None:
                stream = ring_stream = _with_ring_chunks(iterator, session, source)
            async for raw in stream:
                if session.is_finished:
                    raise KvTransferError(pb.KV_PUSH_STATUS_OUT_OF_ORDER, "a message after is_last")
                message, data = _split(raw)
                if message.WhichOneof("kind") != "chunk":
                    raise KvTransferError(pb.KV_PUSH_STATUS_OUT_OF_ORDER, "a second handshake")
                if source is not None and (data or message.chunk.runs):
                    raise KvTransferError(
                        pb.KV_PUSH_STATUS_INVALID_CHUNK,
                        "shm: chunk data travels in the shared-memory ring, not in messages",
                    )
                session.on_chunk(message.chunk, data)
            if not session.is_finished:
                raise KvTransferError(
                    pb.KV_PUSH_STATUS_INCOMPLETE, "the stream ended before a message with is_last"
                )
            return session.reply(pb.KV_PUSH_STATUS_OK, "")
        except KvTransferError as e:
            if session is None:
                return pb.KvPushReply(status=e.status, message=e.message)  # type: ignore[arg-type]
            session.fail(e.status, e.message)
            return session.reply(e.status, e.message)
        except BaseException:
            if session is not None:
                session.fail(pb.KV_PUSH_STATUS_INCOMPLETE, "the push was cancelled or broke")
            raise
        finally:
            if ring_stream is not None:
                await ring_stream.aclose()
            if session is not None and session.source is not None:
                session.source.close()


async def _with_ring_chunks(
    messages: AsyncIterator[bytes], session: ReceiveSession, source: ChunkSource
) -> AsyncGenerator[bytes, None]:
    """The stream's messages; while waiting for each one, ring chunks go to ``session`` as
    they are published, and every chunk published before a message goes before it."""
    while True:
        read = asyncio.ensure_future(anext(messages, None))
        try:
            while not read.done():
                if _take_ring_chunk(session, source):
                    await asyncio.sleep(0)  # one chunk per turn of the loop
                else:
                    await source.wait(read)
            while _take_ring_chunk(session, source):
                pass
        finally:
            read.cancel()  # a refused push: the reply ends the stream
        raw = read.result()
        if raw is None:
            return
        yield raw


def _take_ring_chunk(session: ReceiveSession, source: ChunkSource) -> bool:
    """Writes the ring's next published chunk, if any."""
    try:
        item = source.next_chunk()
    except ValueError as e:
        raise KvTransferError(pb.KV_PUSH_STATUS_INVALID_CHUNK, f"shm: {e}") from e
    if item is None:
        return False
    chunk, data = item
    if chunk.is_last or chunk.extra_tensors:
        raise KvTransferError(
            pb.KV_PUSH_STATUS_INVALID_CHUNK, "shm: the last message travels in the stream"
        )
    session.on_chunk(chunk, data)
    source.consumed()
    return True


def _split(raw: bytes) -> tuple[pb.KvPushMessage, memoryview]:
    try:
        return split_push_message(raw)
    except ValueError as e:
        raise KvTransferError(pb.KV_PUSH_STATUS_INVALID_CHUNK, str(e)) from e


class ReceiveSession:
    """One push into one reservation: every check, then the writes."""

    def __init__(self, record: _Record) -> None:
        self._record = record
        self._layout = record.reservation.layout
        self._checksum: ChecksumFn = zlib.crc32  # set by check_handshake
        self._checksum_kind: int = pb.CHECKSUM_KIND_CRC32
        self.source: ChunkSource | None = None  # the ring of a shared-memory push
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

    def check_handshake(self, hs: pb.KvHandshake, attach: SegmentAttacher | None) -> None:
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
        if hs.HasField("shm"):
            if attach is None:
                self._refuse_incompatible("shm: shared memory is not enabled on this receiver")
            try:
                self.source = attach(hs.shm)
            except (ValueError, OSError) as e:
                self._refuse_incompatible(f"shm: {e}")

    def on_chunk(self, chunk: pb.KvChunk, data: memoryview) -> None:
        """Checks one chunk's header, then writes its data while checksumming it: a refused
        chunk marks nothing written, though a corrupted one may have overwritten its (still
        unwritten, reserved) blocks. ``data`` is the chunk's data field (split off by
        wire.split_push_message) or its data in the ring."""
        self._check_live()
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

    def check_runs(
        self, pool: KvPool, layer_start: int, layer_end: int, runs: Sequence[tuple[int, int]]
    ) -> list[tuple[int, int]]:
        """The runs' blocks as ranges of reservation indices, after checking pool, layers,
        and that every block is reserved and not written yet for these layers."""
        self._check_live()
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

    def write_direct(
        self, pool: KvPool, layer: int, kv: tuple[torch.Tensor, torch.Tensor], runs: list[RunPair]
    ) -> int:
        """Copies runs of one layer straight from a source pool (loopback); returns bytes."""
        dst_runs = [(r.dst_start, r.num_blocks) for r in runs]
        ranges = self.check_runs(pool, layer, layer + 1, dst_runs)
        dst_k, dst_v = self._record.reservation.pools[pool].layers[layer]
        num_bytes = 0
        for run in runs:
            for src, dst in zip(kv, (dst_k, dst_v), strict=True):
                piece = src[run.src_start : run.src_start + run.num_blocks]
                dst[run.dst_start : run.dst_start + run.num_blocks].copy_(piece)
                num_bytes += piece.numel() * piece.element_size()
        self._mark_written(pool, layer, layer + 1, ranges)
        self.num_bytes += num_bytes
        return num_bytes

    def complete(self, extra: dict[str, torch.Tensor]) -> None:
        self._check_live()
        self._complete(extra)

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
        if len(data) != expected:
            self._invalid(f"data: {len(data)} bytes, expected {expected} for these layers and runs")
        if self._write(pool, chunk.layer_start, chunk.layer_end, runs, data) != chunk.checksum:
            raise KvTransferError(
                pb.KV_PUSH_STATUS_CHECKSUM_MISMATCH,
                f"chunk {chunk.sequence_number}: checksum differs from its data",
            )
        self._mark_written(pool, chunk.layer_start, chunk.layer_end, ranges)
        self.num_bytes += len(data)

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
        block_bytes = self._layout.block_bytes(pool) // 2  # K (or V) of one block
        offset = 0
        for layer in range(layer_start, layer_end):
            views = self._pool_bytes(pool, layer)
            for first, num_blocks in runs:
                num_bytes, start = num_blocks * block_bytes, first * block_bytes
                for dst_pool, dst in zip(layers[layer], views, strict=True):
                    src = data[offset : offset + num_bytes]
                    if dst is not None:
                        hash_then_copy(dst[start : start + num_bytes], src, running)
                    else:
                        unpack(dst_pool[first : first + num_blocks], src, running)
                    offset += num_bytes
        return running.intdigest()

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

    def _check_live(self) -> None:
        if self._record.is_released:
            raise KvTransferError(pb.KV_PUSH_STATUS_UNKNOWN_REQUEST, "the reservation was released")
        if self.is_finished:
            raise KvTransferError(pb.KV_PUSH_STATUS_OUT_OF_ORDER, "data after is_last")
        if self._record.state is not TransferState.TRANSFERRING:
            raise KvTransferError(self._record.status, self._record.message)

    def _invalid(self, message: str) -> NoReturn:
        raise KvTransferError(pb.KV_PUSH_STATUS_INVALID_CHUNK, message)

    def _refuse_incompatible(self, message: str) -> NoReturn:
        raise KvTransferError(pb.KV_PUSH_STATUS_INCOMPATIBLE, message)

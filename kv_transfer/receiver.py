"""The receiving side of every transport: reservations, pushes, writes into the pools.

A decode worker ``reserve``s a request's destination blocks, the transport feeds the push
(``receive`` for a KvPushMessage stream, with chunks from a shared-memory ring when the
handshake names one, or headers of blocks written in place into shared pools; a
``ReceiveSession`` for in-process channels), and the worker awaits ``wait_done``. Anything
wrong (checksum, layout, block outside the reservation, sequence gap or repeat, missing KV)
fails the request with a message (session.py).

A same-host sender writing in place may be partway through a chunk when its push is
refused or dropped, so its blocks are reused only once it has provably stopped: the
receiver fences them, reads the stream until the sender half-closes (it checks the fence
before each chunk), and only then lets ``drop``'s future finish. A call that ends
otherwise (cancelled, broken, timed out) keeps them a grace period longer.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import (
    AsyncGenerator,
    AsyncIterable,
    AsyncIterator,
    Awaitable,
    Callable,
    Sequence,
)
from dataclasses import dataclass
from typing import Any

import torch

from kv_transfer.base import KvTransferError, TransferState
from kv_transfer.chunking import stalled
from kv_transfer.session import (
    ChunkSource,
    InPlaceWriter,
    KvReservation,
    ReceiveSession,
    SegmentAttacher,
    TransferRecord,
)
from kv_transfer.shared_pools import (
    BLOCKS_KEY,
    IPC_KEY,
    PLACEMENT_KEY,
    POOLS_KEY,
    SharedKvPools,
    reserved_runs,
)
from kv_transfer.wire import split_push_message
from tandem.v1 import kv_transfer_pb2 as pb

Announce = Callable[[Sequence[tuple[str, str | bytes]]], Awaitable[None]]

__all__ = ["ChunkSource", "KvReceiver", "KvReservation", "ReceiveSession", "SegmentAttacher"]


class KvReceiver:
    """Reservations by request id, checked and written by whatever transport delivers.
    Not thread-safe: use it from the event loop that serves the pushes."""

    def __init__(
        self,
        *,
        epoch: int | None = None,
        attach_segment: SegmentAttacher | None = None,
        shared_pools: SharedKvPools | None = None,
        write_grace_s: float = 1.0,
        fence_timeout_s: float = 30.0,
        stall_s: float = 10.0,
    ) -> None:
        if stall_s <= 0:
            raise ValueError(f"stall_s: must be positive, got {stall_s}")
        self.epoch = epoch  # None: decode_epoch is not checked
        self._attach_segment = attach_segment  # None: shared-memory pushes are refused
        # Where the reserved pools live, for same-host senders to write in place (None: no
        # such pushes; they go through their ring).
        self.shared_pools = shared_pools
        # After an in-place push's call ended without its half-close: how long a copy in
        # flight may still take to land.
        self.write_grace_s = write_grace_s
        # How long a fenced in-place sender may take to half-close before its call is ended.
        self.fence_timeout_s = fence_timeout_s
        # Progress deadline of a push: the handshake, and once KV flows, each next chunk
        # (or the last message), must come within this; else the push fails as stalled.
        # Between the handshake and the first chunk the sender's prefill may queue: that
        # wait is the sender's to bound (its engine), within the push's own deadline.
        self.stall_s = stall_s
        self._records: dict[str, TransferRecord] = {}

    def reserve(self, reservation: KvReservation) -> None:
        if reservation.request_id in self._records:
            raise ValueError(f"request_id: {reservation.request_id!r} is already reserved")
        self._records[reservation.request_id] = TransferRecord(reservation, epoch=self.epoch)

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

    def drop(self, request_id: str) -> asyncio.Future[None] | None:
        """Forgets the request (done, failed or aborted); a push still running is refused
        before its next write. None: its blocks may go to another request now. Else they
        must wait for the future: a same-host sender may still be writing them in place."""
        record = self._records.pop(request_id, None)
        if record is None:
            return None
        record.is_dropped = True
        record.end(TransferState.FAILED, pb.KV_PUSH_STATUS_UNKNOWN_REQUEST, "dropped")
        writer = record.writer
        if writer is None or writer.stopped.done() or record.state is TransferState.DONE:
            return None  # done: every block was written before the last message
        writer.fence()
        return writer.stopped

    def open(self, handshake: pb.KvHandshake) -> ReceiveSession:
        """Starts a push; raises KvTransferError (failing the request where it has one)."""
        record = self._records.get(handshake.request_id)
        if record is None:
            raise KvTransferError(
                pb.KV_PUSH_STATUS_UNKNOWN_REQUEST,
                f"request {handshake.request_id!r} has no reservation here",
            )
        if self.epoch is not None and handshake.decode_epoch != self.epoch:
            error = KvTransferError(
                pb.KV_PUSH_STATUS_STALE_EPOCH,
                f"decode_epoch: sender has {handshake.decode_epoch}, receiver is {self.epoch}",
            )
            if record.state is TransferState.RESERVED and handshake.decode_epoch == record.epoch:
                # Reserved, then this worker registered again: no push can carry the new
                # epoch for it, so it is over. A push of an earlier attempt (an older epoch
                # than the reservation's) fails nothing: the current one may still come.
                record.end(TransferState.FAILED, error.status, error.message)
            raise error
        if record.state is not TransferState.RESERVED:
            raise KvTransferError(
                pb.KV_PUSH_STATUS_OUT_OF_ORDER,
                f"request {handshake.request_id!r} is already {record.state.value}",
            )
        record.state = TransferState.TRANSFERRING
        session = ReceiveSession(record)
        try:
            session.check_handshake(handshake, self._attach_segment, self.shared_pools)
        except KvTransferError as e:
            session.fail(e.status, e.message)
            raise
        return session

    async def receive(
        self, raw_messages: AsyncIterable[bytes], announce: Announce | None = None
    ) -> pb.KvPushReply:
        """Consumes one Push stream of serialized KvPushMessages; the reply says OK or why
        it was refused. Chunk data is checked and written from the received bytes. A
        same-host handshake is answered through ``announce`` (the call's initial metadata):
        write into the shared pools, or use the ring."""
        push = _Push(_Messages(raw_messages))
        try:
            session = await self._read(push, announce)
            return session.reply(pb.KV_PUSH_STATUS_OK, "")
        except KvTransferError as e:
            if push.session is None:
                return pb.KvPushReply(status=e.status, message=e.message)  # type: ignore[arg-type]
            push.session.fail(e.status, e.message)
            if push.session.writer is not None:
                await self._until_half_closed(push.messages, push.session.writer)
            return push.session.reply(e.status, e.message)
        except BaseException:
            if push.session is not None:
                push.session.fail(pb.KV_PUSH_STATUS_INCOMPLETE, "the push was cancelled or broke")
            raise
        finally:
            await self._close(push)

    async def _read(self, push: _Push, announce: Announce | None) -> ReceiveSession:
        """Reads a push to its last message, each within ``stall_s`` (the first chunk
        excepted); raises KvTransferError on anything wrong, a stall included."""
        what = "waiting for the handshake"
        try:
            async with asyncio.timeout(self.stall_s) as stall:
                first = await push.messages.next()
                if first is None:
                    raise KvTransferError(pb.KV_PUSH_STATUS_INCOMPLETE, "no handshake")
                message, _ = _split(first)
                if message.WhichOneof("kind") != "handshake":
                    raise KvTransferError(
                        pb.KV_PUSH_STATUS_OUT_OF_ORDER, "a chunk before the handshake"
                    )
                session = push.session = self.open(message.handshake)
                stall.reschedule(None)  # armed again by the first chunk
                what = "waiting for the next chunk"
                loop = asyncio.get_running_loop()
                session.on_progress = functools.partial(_rearm, stall, session, loop, self.stall_s)
                if message.handshake.HasField("shm") and announce is not None:
                    await announce(_placement(session))
                source = session.source
                stream: AsyncIterator[bytes] = push.messages
                if source is not None:
                    stream = push.ring_stream = _with_ring_chunks(push.messages, session, source)
                elif session.placement is not None:
                    stream = push.ring_stream = _until_dropped(push.messages, session)
                async for raw in stream:
                    if session.is_finished:
                        raise KvTransferError(
                            pb.KV_PUSH_STATUS_OUT_OF_ORDER, "a message after is_last"
                        )
                    message, data = _split(raw)
                    if message.WhichOneof("kind") != "chunk":
                        raise KvTransferError(pb.KV_PUSH_STATUS_OUT_OF_ORDER, "a second handshake")
                    if source is not None and (data or message.chunk.runs):
                        raise KvTransferError(
                            pb.KV_PUSH_STATUS_INVALID_CHUNK,
                            "shm: chunk data travels in the shared-memory ring, not in messages",
                        )
                    session.on_chunk(message.chunk, data)
        except TimeoutError:
            if not stall.expired():
                raise
            raise KvTransferError(
                pb.KV_PUSH_STATUS_INCOMPLETE, stalled(self.stall_s, what)
            ) from None
        if not session.is_finished:
            raise KvTransferError(
                pb.KV_PUSH_STATUS_INCOMPLETE, "the stream ended before a message with is_last"
            )
        return session

    async def _close(self, push: _Push) -> None:
        """Stops reading a push that ended: its stream, its ring; an in-place sender's
        blocks are reusable once it half-closed, else after the write grace."""
        push.messages.close()
        if push.ring_stream is not None:
            await push.ring_stream.aclose()
        session = push.session
        if session is not None and session.source is not None:
            session.source.close()
        if session is not None and session.writer is not None:
            if push.messages.is_ended:  # half-closed: every write came before
                session.writer.has_stopped()
            else:
                session.writer.stops_after(self.write_grace_s)

    async def _until_half_closed(self, messages: _Messages, writer: InPlaceWriter) -> None:
        """Fences a refused in-place push's blocks and reads its stream to the end: the
        sender stops at its next chunk and half-closes (for at most ``fence_timeout_s``)."""
        writer.fence()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.fence_timeout_s):
                while await messages.next() is not None:
                    pass


@dataclass
class _Push:
    """What ``receive`` must clean up after one push, however it ended."""

    messages: _Messages
    session: ReceiveSession | None = None
    ring_stream: AsyncGenerator[bytes, None] | None = None  # wraps messages (ring, pools)


def _rearm(
    stall: asyncio.Timeout,
    session: ReceiveSession,
    loop: asyncio.AbstractEventLoop,
    stall_s: float,
) -> None:
    """A chunk was taken: the next one is due within ``stall_s`` (none after the last)."""
    stall.reschedule(None if session.is_finished else loop.time() + stall_s)


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


def _placement(session: ReceiveSession) -> list[tuple[str, str | bytes]]:
    """The answer to a same-host handshake: the pools and the reserved runs, or the ring."""
    if session.placement is None:
        return [(PLACEMENT_KEY, "ring")]
    runs = reserved_runs(session.block_ids)
    blocks = pb.KvChunk(
        runs=[pb.BlockRun(first_block_id=r.dst_start, num_blocks=r.num_blocks) for r in runs]
    )
    placed = [
        (POOLS_KEY, session.placement.segment().SerializeToString()),
        (BLOCKS_KEY, blocks.SerializeToString()),
    ]
    if session.placement.ipc is not None:  # on a GPU: its handle, the segment its fences
        return [(PLACEMENT_KEY, "cuda_ipc"), (IPC_KEY, session.placement.ipc.to_bytes()), *placed]
    return [(PLACEMENT_KEY, "pools"), *placed]


async def _until_dropped(
    messages: _Messages, session: ReceiveSession
) -> AsyncGenerator[bytes, None]:
    """The stream's messages, ended early (refusing the push) once the reservation is
    dropped; the read under way is kept for whoever reads the stream to its end."""
    ended = asyncio.ensure_future(session.ended())
    try:
        while True:
            read = messages.read()
            waits: set[asyncio.Future[Any]] = {read, ended}
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            if not read.done() and not session.is_finished:
                session.check_live()  # raises: dropped or failed
            raw = await messages.next()
            if raw is None:
                return
            yield raw
    finally:
        ended.cancel()


class _Messages:
    """A Push stream's messages, one read at a time; ``is_ended`` once the sender
    half-closed. A read left pending by a caller that stopped waiting is the next one's."""

    def __init__(self, raw_messages: AsyncIterable[bytes]) -> None:
        self._iterator = aiter(raw_messages)
        self._read: asyncio.Future[bytes | None] | None = None
        self.is_ended = False

    def read(self) -> asyncio.Future[bytes | None]:
        """The next message (None: the end), as a future."""
        if self._read is None:
            self._read = asyncio.ensure_future(anext(self._iterator, None))
        return self._read

    async def next(self) -> bytes | None:
        if self.is_ended:
            return None
        raw = await self.read()
        self._read = None
        self.is_ended = raw is None
        return raw

    def __aiter__(self) -> _Messages:
        return self

    async def __anext__(self) -> bytes:
        raw = await self.next()
        if raw is None:
            raise StopAsyncIteration
        return raw

    def close(self) -> None:
        if self._read is not None:
            self._read.cancel()

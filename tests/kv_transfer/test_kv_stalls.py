"""Progress deadlines of a KV push (``stall_s``), both ends live, over gRPC and the
shared-memory ring: a receiver that stops taking chunks fails the sender, and a sender that
stops sending fails the receiver, each within the deadline and naming the stall; the other
side learns it at once and both let the push go. A push whose first chunk has not come (its
prefill still queued) is not stalled. Stalls are injected by holding the receiver's stream
or ring, and by a sender that simply stops: no sleeps race the transfer."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import grpc
import pytest
import torch

from kv_transfer import (
    Handshake,
    KvPool,
    KvReceiver,
    KvReservation,
    KvTransferError,
    SharedKvPools,
    ShmAttacher,
    ShmRingPool,
    TransferOptions,
    TransferState,
    add_kv_transfer_servicer,
    grpc_sender,
    server_options,
    shm_sender,
)
from kv_transfer.chunking import ChunkedKvSender
from kv_transfer.receiver import ChunkSource
from tandem.v1 import kv_transfer_pb2 as pb
from tests.kv_transfer.kv_pools import (
    DST_IDS,
    DST_SEED,
    SRC_IDS,
    SRC_SEED,
    layout_for,
    make_pools,
    push_all,
)

STALL_S = 0.3
LONG_S = 30.0  # the other side's deadline: never reached in these tests
WRITE_GRACE_S = 0.2
# A target layer (9 blocks of 512 B in fp32) leaves in 5 chunks; 2 ring slots.
OPTIONS = TransferOptions(chunk_bytes=1024, window=2, timeout_s=LONG_S, stall_s=STALL_S)
PATIENT = dataclasses.replace(OPTIONS, stall_s=LONG_S)  # where the receiver's is under test
LAYOUT = layout_for(torch.float32)


class Held:
    """A receiver that takes ``num_open`` stream messages or ring chunks, then none (as
    one whose event loop or engine stopped reading), until the push ends."""

    def __init__(self, num_open: int) -> None:
        self.num_open = num_open
        self.num_taken = 0
        self.is_holding = asyncio.Event()  # set once it stopped taking

    async def messages(self, raw: AsyncIterable[bytes]) -> AsyncIterator[bytes]:
        async for message in raw:
            if self.num_taken == self.num_open:
                self.is_holding.set()
                await asyncio.Event().wait()  # until the call is cancelled
            self.num_taken += 1
            yield message


class HeldSource:
    """A ring (ChunkSource) whose reader stops after ``held.num_open`` chunks."""

    def __init__(self, inner: ChunkSource, held: Held) -> None:
        self.inner, self.held = inner, held

    def next_chunk(self) -> tuple[pb.KvChunk, memoryview] | None:
        if self.held.num_taken == self.held.num_open:
            self.held.is_holding.set()
            return None
        item = self.inner.next_chunk()
        self.held.num_taken += item is not None
        return item

    def consumed(self) -> None:
        self.inner.consumed()

    async def wait(self, until: asyncio.Future[Any]) -> None:
        if self.held.is_holding.is_set():
            await asyncio.wait({until})  # the stream's end only
        else:
            await self.inner.wait(until)

    def close(self) -> None:
        self.inner.close()


class Server:
    """A KvTransfer server whose receiver has deadline ``stall_s``; with ``held``, its
    stream (gRPC) or ring (shm) stops being read as ``held`` says; with ``fence_timeout_s``
    its pools are shared, for same-host senders to write in place."""

    def __init__(
        self,
        stall_s: float,
        held: Held | None = None,
        *,
        ring: bool = False,
        fence_timeout_s: float | None = None,
    ) -> None:
        self.pools = make_pools(LAYOUT, DST_SEED)
        self.shared = None
        if fence_timeout_s is not None:
            self.shared = SharedKvPools.adopt(LAYOUT, {p.value: c for p, c in self.pools.items()})
        attacher = ShmAttacher()

        def attach(segment: pb.ShmSegment) -> ChunkSource:
            source = attacher(segment)
            return HeldSource(source, held) if held is not None and ring else source

        self.receiver = KvReceiver(
            attach_segment=attach,
            shared_pools=self.shared,
            stall_s=stall_s,
            write_grace_s=WRITE_GRACE_S,
            fence_timeout_s=fence_timeout_s or LONG_S,
        )
        if held is not None and not ring:
            receive = self.receiver.receive

            def held_receive(raw: AsyncIterable[bytes], announce: Any = None) -> Awaitable[Any]:
                return receive(held.messages(raw), announce)

            self.receiver.receive = held_receive  # type: ignore[method-assign]
        self.server = grpc.aio.server(options=server_options())
        add_kv_transfer_servicer(self.server, self.receiver)
        port = self.server.add_insecure_port("127.0.0.1:0")
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")

    def reserve(self, request_id: str) -> None:
        self.receiver.reserve(KvReservation(request_id, DST_IDS, self.pools, LAYOUT))

    async def failed_within(self, request_id: str, within_s: float) -> str:
        """The push's failure message, once the receiver failed it (within ``within_s``)."""
        with pytest.raises(KvTransferError) as failed:
            await self.receiver.wait_done(request_id, timeout=within_s)
        assert self.receiver.state(request_id) is TransferState.FAILED
        return failed.value.message


@pytest.fixture
def rings() -> Iterator[ShmRingPool]:
    pool = ShmRingPool.for_options(OPTIONS)
    yield pool
    pool.close()


async def serving(server: Server) -> None:
    await server.server.start()


def make(
    transport: str, server: Server, rings: ShmRingPool, options: TransferOptions = PATIENT
) -> ChunkedKvSender:
    if transport == "shm":
        return shm_sender(server.channel, rings, options)
    return grpc_sender(server.channel, options)


async def stop(server: Server) -> None:
    await server.channel.close()
    await server.server.stop(0)
    if server.shared is not None:
        server.shared.close()


async def timed(work: Callable[[], Awaitable[None]]) -> tuple[KvTransferError, float]:
    start = time.monotonic()
    with pytest.raises(KvTransferError) as failed:
        await work()
    return failed.value, time.monotonic() - start


@pytest.mark.parametrize("transport", ["grpc", "shm"])
async def test_a_receiver_that_stops_reading_fails_the_sender(
    transport: str, rings: ShmRingPool
) -> None:
    """The receiver takes the handshake and two chunks, then nothing: the sender aborts
    within its deadline naming the stall, the receiver fails the push as soon as the
    sender's abort reaches it, and the sender's ring is closed, not pooled."""
    held = Held(num_open=3 if transport == "grpc" else 2)  # gRPC: the handshake is one
    server = Server(LONG_S, held, ring=transport == "shm")
    await serving(server)
    try:
        server.reserve("r1")
        sender = make(transport, server, rings, OPTIONS)
        src = make_pools(LAYOUT, SRC_SEED)
        error, seconds = await timed(lambda: push_all(sender, "r1", LAYOUT, src))
        assert held.is_holding.is_set() and held.num_taken == held.num_open
        assert error.status == pb.KV_PUSH_STATUS_INCOMPLETE
        # gRPC: the chunks fit the stream's window, the wait is for the reply; shm: the
        # two ring slots fill, the wait is for a free one.
        what = "waiting for the receiver's reply" if transport == "grpc" else "room for a chunk"
        assert error.message.startswith(f"stalled: nothing moved for {STALL_S:g} s while ")
        assert what in error.message and error.message.endswith("(transfer_stall_s)")
        assert STALL_S <= seconds < STALL_S + 2.0
        assert sender.state is TransferState.FAILED
        message = await server.failed_within("r1", within_s=1.0)
        assert message == "the push was cancelled or broke"
        assert rings._idle == [] and rings._open == set()  # the ring is closed, not reused
    finally:
        await stop(server)


@pytest.mark.parametrize("transport", ["grpc", "shm"])
async def test_a_sender_that_stops_sending_fails_the_receiver(
    transport: str, rings: ShmRingPool
) -> None:
    """The sender sends target layer 0 (five chunks), then stops, alive: the receiver
    fails the push within its deadline naming the stall, and the sender's next step gets
    the receiver's reason."""
    server = Server(STALL_S)
    await serving(server)
    try:
        server.reserve("r1")
        sender = make(transport, server, rings)
        src = make_pools(LAYOUT, SRC_SEED)
        await sender.begin(Handshake("r1", LAYOUT))
        await sender.send_layer(KvPool.TARGET, 0, src[KvPool.TARGET].layers[0], SRC_IDS, DST_IDS)
        sent = time.monotonic()
        message = await server.failed_within("r1", within_s=STALL_S + 2.0)
        assert time.monotonic() - sent >= STALL_S - 0.05
        assert message == (
            f"stalled: nothing moved for {STALL_S:g} s while waiting for the next chunk "
            "(transfer_stall_s)"
        )
        with pytest.raises(KvTransferError) as told:
            await sender.send_layer(
                KvPool.TARGET, 1, src[KvPool.TARGET].layers[1], SRC_IDS, DST_IDS
            )
            await sender.finish()
        assert told.value.status == pb.KV_PUSH_STATUS_INCOMPLETE
        assert told.value.message == message
        assert sender.state is TransferState.FAILED
    finally:
        await stop(server)


async def test_a_sender_stalled_writing_in_place_keeps_the_blocks_until_it_stopped(
    rings: ShmRingPool,
) -> None:
    """Same host, shared pools: the sender writes target layer 0 in place, then stops. The
    receiver fails the push as stalled, but a sender that may resume writing keeps the
    blocks fenced: they are free once it half-closes at its next step, or, if it never
    does, once the fence wait and the write grace are over."""
    fence_timeout_s = 0.5
    for resumes in (True, False):
        server = Server(STALL_S, fence_timeout_s=fence_timeout_s)
        await serving(server)
        try:
            server.reserve("r1")
            sender = make("shm", server, rings)
            src = make_pools(LAYOUT, SRC_SEED)
            await sender.begin(Handshake("r1", LAYOUT))
            kv = src[KvPool.TARGET].layers[0]
            await sender.send_layer(KvPool.TARGET, 0, kv, SRC_IDS, DST_IDS)
            assert sender.is_placed
            message = await server.failed_within("r1", within_s=STALL_S + 2.0)
            assert message.startswith("stalled: nothing moved for") and "next chunk" in message
            stopped = server.receiver.drop("r1")  # the decode worker's expiry
            assert stopped is not None and not stopped.done()
            released = time.monotonic()
            if resumes:
                with pytest.raises(KvTransferError) as told:
                    kv = src[KvPool.TARGET].layers[1]
                    await sender.send_layer(KvPool.TARGET, 1, kv, SRC_IDS, DST_IDS)
                assert told.value.message == message
                await asyncio.wait_for(stopped, 2.0)
            else:
                await asyncio.wait_for(stopped, fence_timeout_s + WRITE_GRACE_S + 2.0)
                assert time.monotonic() - released >= WRITE_GRACE_S - 0.05
        finally:
            await stop(server)


async def test_no_stall_before_the_first_chunk() -> None:
    """Between the handshake and the first chunk the sender's prefill may be queued: the
    receiver's deadline is not armed then, and the push completes after a long wait."""
    server = Server(STALL_S)
    await serving(server)
    try:
        server.reserve("r1")
        sender = grpc_sender(server.channel, PATIENT)
        src = make_pools(LAYOUT, SRC_SEED)
        await sender.begin(Handshake("r1", LAYOUT))
        await asyncio.sleep(3 * STALL_S)
        assert server.receiver.state("r1") is TransferState.TRANSFERRING
        for pool in KvPool:
            for layer, kv in enumerate(src[pool].layers):
                await sender.send_layer(pool, layer, kv, SRC_IDS, DST_IDS)
        await sender.finish()
        await server.receiver.wait_done("r1", timeout=5)
        assert sender.state is TransferState.DONE
    finally:
        await stop(server)


async def test_a_handshake_that_never_comes_is_a_stall() -> None:
    """A push stream with no handshake within the deadline is refused as stalled (fed to
    the receiver directly: a gRPC client sends the call's headers with its first message)."""
    receiver = KvReceiver(stall_s=STALL_S)

    async def nothing() -> AsyncIterator[bytes]:
        await asyncio.Event().wait()
        yield b""

    reply = await asyncio.wait_for(receiver.receive(nothing()), 5)
    assert reply.status == pb.KV_PUSH_STATUS_INCOMPLETE
    assert reply.message == (
        f"stalled: nothing moved for {STALL_S:g} s while waiting for the handshake "
        "(transfer_stall_s)"
    )


def test_stall_deadlines_must_be_positive() -> None:
    with pytest.raises(ValueError, match="stall_s: must be positive"):
        TransferOptions(stall_s=0)
    with pytest.raises(ValueError, match="stall_s: must be positive, got -1"):
        KvReceiver(stall_s=-1)

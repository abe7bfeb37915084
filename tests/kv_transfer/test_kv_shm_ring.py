"""The shared-memory ring: chunk headers in the slots, pipe wake-ups both ways, checksums
taken piece by piece; corrupted slots, a stalled receiver and misuse are refused."""

from __future__ import annotations

import asyncio
import os
import time
import zlib
from collections.abc import AsyncIterator, Iterable
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
    ShmAttacher,
    ShmRingPool,
    TransferOptions,
    TransferState,
    shm_sender,
)
from kv_transfer.checksum import checksum_function, running_checksum
from kv_transfer.copying import PIECE_BYTES, copy_then_hash, hash_then_copy
from kv_transfer.grpc_transport import SERVICE
from kv_transfer.shared_pools import PLACEMENT_KEY
from kv_transfer.shm_transport import HEADER_BYTES, SLOT_HEADER, ShmRing
from tandem.v1 import kv_transfer_pb2 as pb
from tests.kv_transfer.kv_pools import (
    DST_IDS,
    DST_SEED,
    SRC_IDS,
    SRC_SEED,
    Receiving,
    is_held,
    layout_for,
    make_pools,
    mismatches,
    push_all,
)

# fp32 tiny layout: one block of one layer is 512 bytes, so every chunk is one block.
ONE_BLOCK_CHUNKS = TransferOptions(chunk_bytes=512, window=1, timeout_s=10)
NUM_ONE_BLOCK_CHUNKS = (3 + 1) * len(DST_IDS)  # target and draft layers, 9 blocks each


@pytest.fixture
def rings() -> Iterable[ShmRingPool]:
    pool = ShmRingPool.for_options(ONE_BLOCK_CHUNKS)
    yield pool
    pool.close()


@pytest.mark.parametrize("kind", [pb.CHECKSUM_KIND_CRC32, pb.CHECKSUM_KIND_XXH3_64])
def test_checksums_taken_piece_by_piece_equal_the_one_shot_value(kind: int) -> None:
    data = os.urandom(3 * PIECE_BYTES + 1234)
    one_shot = checksum_function(kind)
    assert one_shot is not None
    packed, unpacked = bytearray(len(data)), bytearray(len(data))
    sent, received = running_checksum(kind), running_checksum(kind)
    copy_then_hash(memoryview(packed), memoryview(data), sent)
    hash_then_copy(memoryview(unpacked), memoryview(packed), received)
    assert packed == unpacked == data
    assert sent.intdigest() == received.intdigest() == one_shot(data)
    assert running_checksum(kind).intdigest() == one_shot(b"")


async def test_many_chunks_through_a_one_slot_ring_arrive_in_order(
    receiving: Receiving, rings: ShmRingPool
) -> None:
    """Window 1: every chunk waits for a wake-up each way; a lost one would stall the push
    until its timeout."""
    layout = layout_for(torch.float32)
    dst = receiving.reserve("r1", layout)
    src = make_pools(layout, SRC_SEED)
    sender = shm_sender(receiving.channel, rings, ONE_BLOCK_CHUNKS)
    start = time.monotonic()
    await push_all(sender, "r1", layout, src)
    await receiving.receiver.wait_done("r1", timeout=5)
    assert time.monotonic() - start < ONE_BLOCK_CHUNKS.timeout_s / 2
    assert sender.state is TransferState.DONE
    assert sender.num_chunks_sent == NUM_ONE_BLOCK_CHUNKS
    assert mismatches(dst, src, make_pools(layout, DST_SEED)) == []


async def test_rings_are_pooled_after_success_and_closed_after_failure(
    receiving: Receiving, rings: ShmRingPool
) -> None:
    layout = layout_for(torch.float32)
    src = make_pools(layout, SRC_SEED)
    for request_id in ("r1", "r2"):
        receiving.reserve(request_id, layout)
        await push_all(
            shm_sender(receiving.channel, rings, ONE_BLOCK_CHUNKS), request_id, layout, src
        )
    first, second = receiving.rings_seen
    assert first == second, "the second push reused the first one's ring"
    assert is_held(first)  # the ring and its two pipes, kept for reuse

    def flip_a_byte(sequence_number: int, data: torch.Tensor) -> None:
        if sequence_number == 2:
            data[5] ^= 0x01

    receiving.reserve("r3", layout)
    sender = shm_sender(receiving.channel, rings, ONE_BLOCK_CHUNKS, tamper=flip_a_byte)
    with pytest.raises(KvTransferError, match="CHECKSUM_MISMATCH: chunk 2: checksum"):
        await push_all(sender, "r3", layout, src)
    assert receiving.rings_seen[-1] == first
    assert not is_held(first), "a ring that saw a failure is not reused"
    receiving.reserve("r4", layout)
    await push_all(shm_sender(receiving.channel, rings, ONE_BLOCK_CHUNKS), "r4", layout, src)
    assert receiving.rings_seen[-1] != first
    assert is_held(receiving.rings_seen[-1])
    rings.close()
    assert not is_held(receiving.rings_seen[-1])


async def test_a_receiver_that_stops_consuming_times_the_sender_out() -> None:
    rings_seen: list[pb.ShmSegment] = []

    async def stalled_push(request_iterator: AsyncIterator[bytes], context: Any) -> bytes:
        """Takes the handshake, answers "use the ring", then never consumes a chunk."""
        first = await anext(aiter(request_iterator))
        rings_seen.append(pb.KvPushMessage.FromString(first).handshake.shm)
        await context.send_initial_metadata([(PLACEMENT_KEY, "ring")])
        async for _ in request_iterator:
            pass
        return pb.KvPushReply(status=pb.KV_PUSH_STATUS_OK).SerializeToString()

    server = grpc.aio.server()
    handlers = {"Push": grpc.stream_unary_rpc_method_handler(stalled_push)}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    options = TransferOptions(chunk_bytes=512, window=2, timeout_s=1)
    rings = ShmRingPool.for_options(options)
    layout = layout_for(torch.float32)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            sender = shm_sender(channel, rings, options)
            start = time.monotonic()
            with pytest.raises(KvTransferError) as stalled:
                await push_all(sender, "r1", layout, make_pools(layout, SRC_SEED))
        assert stalled.value.status == pb.KV_PUSH_STATUS_INCOMPLETE
        assert time.monotonic() - start < 5
        assert sender.state is TransferState.FAILED
        assert sender.num_chunks_sent == options.window  # the ring filled, then nothing
        assert not is_held(rings_seen[0])  # closed: a failed push's ring is not reused
    finally:
        rings.close()
        await server.stop(0)


async def test_release_stops_a_running_shm_push(receiving: Receiving, rings: ShmRingPool) -> None:
    layout = layout_for(torch.float32)
    receiving.reserve("r1", layout)
    src = make_pools(layout, SRC_SEED)
    sender = shm_sender(receiving.channel, rings, ONE_BLOCK_CHUNKS)
    await sender.begin(Handshake("r1", layout))
    await sender.send_layer(KvPool.TARGET, 0, src[KvPool.TARGET].layers[0], SRC_IDS, DST_IDS)
    receiving.receiver.drop("r1")
    with pytest.raises(KvTransferError, match="UNKNOWN_REQUEST: the reservation was dropped"):
        for layer in range(1, 3):
            await sender.send_layer(
                KvPool.TARGET, layer, src[KvPool.TARGET].layers[layer], SRC_IDS, DST_IDS
            )
        await sender.finish()
    assert sender.state is TransferState.FAILED


# ---------------------------------------------------------------- slots written by hand


class HandRing:
    """A ring written by the test: a receiver, a reservation, and a push to feed."""

    def __init__(self) -> None:
        self.layout = layout_for(torch.float32)
        self.ring = ShmRing.create(data_bytes=4096, num_slots=2)
        self.receiver = KvReceiver(attach_segment=ShmAttacher())
        self.receiver.reserve(
            KvReservation("r1", DST_IDS, make_pools(self.layout, DST_SEED), self.layout)
        )

    def handshake(self) -> bytes:
        hs = self.layout.to_handshake("r1", 0, pb.CHECKSUM_KIND_CRC32)
        hs.shm.CopyFrom(self.ring.segment())
        return pb.KvPushMessage(handshake=hs).SerializeToString()

    def publish(self, sequence_number: int, *, flip: bool = False) -> pb.KvChunk:
        """Chunk ``sequence_number``: one block of target layer 0, checksummed, published."""
        data = os.urandom(self.layout.block_bytes(KvPool.TARGET))
        header = pb.KvChunk(
            sequence_number=sequence_number,
            layer_start=0,
            layer_end=1,
            pool=pb.KV_POOL_TARGET,
            runs=[pb.BlockRun(first_block_id=DST_IDS[sequence_number], num_blocks=1)],
            dtype="float32",
            checksum=zlib.crc32(data),
        )
        if flip:
            data = bytes([data[0] ^ 1]) + data[1:]
        slot = self.ring.data(sequence_number, len(data))
        slot.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        self.ring.publish(header, len(data))
        return header

    def slot_offset(self, sequence_number: int) -> int:
        return HEADER_BYTES + (sequence_number % self.ring.num_slots) * self.ring.slot_bytes

    async def push(self, *later: bytes, gate: asyncio.Event | None = None) -> pb.KvPushReply:
        async def stream() -> AsyncIterator[bytes]:
            yield self.handshake()
            if gate is not None:
                await gate.wait()
            for message in later:
                yield message

        return await asyncio.wait_for(self.receiver.receive(stream()), 5)

    def close(self) -> None:
        self.ring.close()


@pytest.fixture
def hand() -> Iterable[HandRing]:
    ring = HandRing()
    yield ring
    ring.close()


def last(sequence_number: int) -> bytes:
    chunk = pb.KvChunk(sequence_number=sequence_number, is_last=True)
    return pb.KvPushMessage(chunk=chunk).SerializeToString()


async def test_hand_written_slots_are_written_then_the_last_message_ends_the_push(
    hand: HandRing,
) -> None:
    hand.publish(0)
    hand.publish(1)
    reply = await hand.push(last(2))
    assert (reply.status, reply.num_chunks_received) == (pb.KV_PUSH_STATUS_INCOMPLETE, 3)
    assert reply.message.endswith("never arrived")  # two blocks of 9 were sent


def _corrupt_sequence(hand: HandRing) -> None:
    SLOT_HEADER.pack_into(hand.ring.tensor.numpy(), hand.slot_offset(0), 7, 512, 10)


def _corrupt_lengths(hand: HandRing) -> None:
    SLOT_HEADER.pack_into(hand.ring.tensor.numpy(), hand.slot_offset(0), 0, 1 << 20, 10)


def _corrupt_header_bytes(hand: HandRing) -> None:
    """A KvChunk header cut inside its first varint."""
    offset = hand.slot_offset(0)
    SLOT_HEADER.pack_into(hand.ring.tensor.numpy(), offset, 0, 512, 2)
    start = offset + SLOT_HEADER.size
    hand.ring.tensor[start : start + 2] = torch.tensor([0x08, 0x80], dtype=torch.uint8)


@pytest.mark.parametrize(
    ("corrupt", "words"),
    [
        (_corrupt_sequence, "holds chunk 7, expected 0"),
        (_corrupt_lengths, "chunk 0: header 10 or data 1048576 bytes"),
        (_corrupt_header_bytes, "chunk 0: not a KvChunk header"),
    ],
    ids=["sequence", "lengths", "header"],
)
async def test_a_corrupted_slot_header_is_refused(hand: HandRing, corrupt, words: str) -> None:
    hand.publish(0)
    corrupt(hand)
    reply = await hand.push(gate=asyncio.Event())  # the refusal ends the push
    assert reply.status == pb.KV_PUSH_STATUS_INVALID_CHUNK
    assert reply.message.startswith("shm: ") and words in reply.message, reply.message
    assert hand.receiver.state("r1") is TransferState.FAILED


async def test_corrupted_data_in_a_slot_is_refused(hand: HandRing) -> None:
    hand.publish(0)
    hand.publish(1, flip=True)
    reply = await hand.push(gate=asyncio.Event())
    assert reply.status == pb.KV_PUSH_STATUS_CHECKSUM_MISMATCH
    assert reply.message == "chunk 1: checksum differs from its data"
    assert reply.num_chunks_received == 1


async def test_the_last_message_in_the_ring_and_data_in_the_stream_are_refused(
    hand: HandRing,
) -> None:
    hand.ring.publish(pb.KvChunk(sequence_number=0, is_last=True), 0)
    reply = await hand.push(gate=asyncio.Event())
    assert reply.status == pb.KV_PUSH_STATUS_INVALID_CHUNK
    assert reply.message == "shm: the last message travels in the stream"

    hand.receiver.reserve(
        KvReservation("r2", DST_IDS, make_pools(hand.layout, DST_SEED), hand.layout)
    )
    hs = hand.layout.to_handshake("r2", 0, pb.CHECKSUM_KIND_CRC32)
    hs.shm.CopyFrom(hand.ring.segment())
    inline = pb.KvChunk(sequence_number=0, layer_end=1, pool=pb.KV_POOL_TARGET, data=b"x" * 512)
    inline.runs.add(first_block_id=DST_IDS[0], num_blocks=1)

    async def stream() -> AsyncIterator[bytes]:
        yield pb.KvPushMessage(handshake=hs).SerializeToString()
        yield pb.KvPushMessage(chunk=inline).SerializeToString()

    reply = await hand.receiver.receive(stream())
    assert reply.status == pb.KV_PUSH_STATUS_INVALID_CHUNK
    assert "chunk data travels in the shared-memory ring" in reply.message


async def test_a_ring_serves_one_push_at_a_time(hand: HandRing) -> None:
    hand.receiver.reserve(
        KvReservation("r2", DST_IDS, make_pools(hand.layout, DST_SEED), hand.layout)
    )
    gate = asyncio.Event()
    first = asyncio.ensure_future(hand.push(last(0), gate=gate))
    while hand.receiver.state("r1") is not TransferState.TRANSFERRING:
        await asyncio.sleep(0.01)
    hs = hand.layout.to_handshake("r2", 0, pb.CHECKSUM_KIND_CRC32)
    hs.shm.CopyFrom(hand.ring.segment())

    async def stream() -> AsyncIterator[bytes]:
        yield pb.KvPushMessage(handshake=hs).SerializeToString()

    reply = await hand.receiver.receive(stream())
    assert reply.status == pb.KV_PUSH_STATUS_INCOMPATIBLE
    assert reply.message == f"shm: {hand.ring.name} is in use by another push"
    gate.set()
    assert (await first).status == pb.KV_PUSH_STATUS_INCOMPLETE  # no KV: never arrived


@pytest.mark.parametrize(
    ("edit", "words"),
    [
        (lambda s: s.ClearField("free"), "a ring needs its file and both pipes"),
        (lambda s: setattr(s, "num_slots", 0), "num_slots: 0 outside"),
        (lambda s: setattr(s, "data_offset", s.slot_bytes), "data_offset:"),
        (lambda s: setattr(s, "size", s.size + 4096), "size:"),
        (lambda s: setattr(s.file, "fd", 999_999), "No such file"),
        (lambda s: setattr(s.file, "inode", s.file.inode + 1), "no longer the announced file"),
        (lambda s: setattr(s.file, "fd", s.ready.fd), "no longer the announced file"),
    ],
    ids=["pipes", "slots", "offset", "size", "closed", "replaced", "a-pipe"],
)
async def test_a_bad_segment_is_refused_at_the_handshake(hand: HandRing, edit, words: str) -> None:
    hs = hand.layout.to_handshake("r1", 0, pb.CHECKSUM_KIND_CRC32)
    hs.shm.CopyFrom(hand.ring.segment())
    edit(hs.shm)

    async def stream() -> AsyncIterator[bytes]:
        yield pb.KvPushMessage(handshake=hs).SerializeToString()

    reply = await hand.receiver.receive(stream())
    assert reply.status == pb.KV_PUSH_STATUS_INCOMPATIBLE
    assert reply.message.startswith("shm: ") and words in reply.message, reply.message

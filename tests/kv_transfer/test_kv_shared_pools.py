"""Same-host pushes into shared pools: each block written once, straight into its reserved
destination block; the reservation bounds what a sender writes, and a checksum over the
destination is checked before the request is admitted."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

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
    server_options,
    shm_sender,
)
from kv_transfer.receiver import ChunkSource
from tandem.v1 import kv_transfer_pb2 as pb
from tests.kv_transfer.kv_pools import (
    DST_IDS,
    DST_SEED,
    SRC_IDS,
    SRC_SEED,
    bits,
    extra_tensors,
    layout_for,
    make_pools,
    mismatches,
    push_all,
)

SMALL_CHUNKS = TransferOptions(chunk_bytes=1024, window=2, timeout_s=10)
LAYOUT = layout_for(torch.float32)


class SharedReceiving:
    """A receiver whose pools live in a shared segment, behind a grpc.aio server."""

    def __init__(self) -> None:
        self.pools = make_pools(LAYOUT, DST_SEED)
        self.shared = SharedKvPools.adopt(LAYOUT, {p.value: c for p, c in self.pools.items()})
        assert self.shared is not None
        self.ring_names: list[str] = []
        attacher = ShmAttacher()

        def attach(segment: pb.ShmSegment) -> ChunkSource:
            self.ring_names.append(segment.name)
            return attacher(segment)

        self.receiver = KvReceiver(attach_segment=attach, shared_pools=self.shared)
        self.server = grpc.aio.server(options=server_options())
        add_kv_transfer_servicer(self.server, self.receiver)
        port = self.server.add_insecure_port("127.0.0.1:0")
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        self.rings = ShmRingPool.for_options(SMALL_CHUNKS)

    def reserve(self, request_id: str, block_ids: tuple[int, ...] = DST_IDS) -> None:
        self.receiver.reserve(KvReservation(request_id, block_ids, self.pools, LAYOUT))


@pytest.fixture
async def shared() -> AsyncIterator[SharedReceiving]:
    r = SharedReceiving()
    await r.server.start()
    yield r
    await r.channel.close()
    await r.server.stop(0)
    r.rings.close()
    r.shared.close()


def test_pools_move_into_the_segment_with_their_contents() -> None:
    pools = make_pools(LAYOUT, DST_SEED)
    k = pools[KvPool.TARGET].layers[1][0]
    shared = SharedKvPools.adopt(LAYOUT, {p.value: c for p, c in pools.items()})
    assert shared is not None
    assert pools[KvPool.TARGET].layers[1][0] is k  # the engine's tensors, moved in place
    assert k.data_ptr() == shared.layer(KvPool.TARGET, 1)[0].data_ptr()
    assert mismatches(pools, pools, make_pools(LAYOUT, DST_SEED), [], []) == []
    assert shared.holds(KvPool.DRAFT, pools[KvPool.DRAFT].layers)
    assert not shared.holds(KvPool.TARGET, make_pools(LAYOUT, DST_SEED)[KvPool.TARGET].layers)
    shared.close()
    assert not shared.is_linked()


@pytest.mark.parametrize("options", [SMALL_CHUNKS, TransferOptions()], ids=["split", "grouped"])
async def test_blocks_are_written_once_in_place(
    shared: SharedReceiving, options: TransferOptions
) -> None:
    shared.reserve("r1")
    src = make_pools(LAYOUT, SRC_SEED)
    rings = ShmRingPool.for_options(options)
    sender = shm_sender(shared.channel, rings, options)
    await push_all(sender, "r1", LAYOUT, src)
    rings.close()
    extra = await shared.receiver.wait_done("r1", timeout=5)
    assert sender.state is TransferState.DONE
    assert sender.is_placed
    assert shared.ring_names == []  # no ring was mapped: the blocks went in place
    assert mismatches(shared.pools, src, make_pools(LAYOUT, DST_SEED)) == []
    assert torch.equal(extra["hidden_states"], extra_tensors(LAYOUT.dtype)["hidden_states"])
    assert sender.num_bytes_sent == sum(
        LAYOUT.block_bytes(p) * len(DST_IDS) * s.num_layers
        for p in KvPool
        if (s := LAYOUT.pool_shape(p)) is not None
    )


async def test_a_sender_cannot_write_outside_its_reservation(shared: SharedReceiving) -> None:
    shared.reserve("r1")
    outside = 15
    assert outside not in DST_IDS
    before = bits(shared.pools[KvPool.TARGET].layers[0][0][outside]).clone()
    sender = shm_sender(shared.channel, shared.rings, SMALL_CHUNKS)
    src = make_pools(LAYOUT, SRC_SEED)
    with pytest.raises(KvTransferError, match=f"block {outside} is outside the reservation"):
        await push_all(sender, "r1", LAYOUT, src, [1, 2], [DST_IDS[0], outside])
    assert sender.state is TransferState.FAILED
    assert torch.equal(bits(shared.pools[KvPool.TARGET].layers[0][0][outside]), before)
    with pytest.raises(KvTransferError, match="INCOMPLETE"):
        await shared.receiver.wait_done("r1", timeout=5)


async def test_a_corrupted_block_is_refused_and_the_request_not_admitted(
    shared: SharedReceiving,
) -> None:
    shared.reserve("r1")

    def flip_a_byte(sequence_number: int, data: torch.Tensor) -> None:
        if sequence_number == 1:
            data[17] ^= 0x40  # in the receiver's pool, after the checksum was taken

    sender = shm_sender(shared.channel, shared.rings, SMALL_CHUNKS, tamper=flip_a_byte)
    with pytest.raises(KvTransferError) as refused:
        await push_all(sender, "r1", LAYOUT, make_pools(LAYOUT, SRC_SEED))
    assert refused.value.status == pb.KV_PUSH_STATUS_CHECKSUM_MISMATCH
    assert sender.is_placed
    assert shared.receiver.state("r1") is TransferState.FAILED
    assert "chunk 1: checksum" in shared.receiver.failure("r1")
    with pytest.raises(KvTransferError, match="CHECKSUM_MISMATCH"):
        await shared.receiver.wait_done("r1", timeout=1)


async def test_release_stops_a_push_into_shared_pools(shared: SharedReceiving) -> None:
    shared.reserve("r1")
    src = make_pools(LAYOUT, SRC_SEED)
    sender = shm_sender(shared.channel, shared.rings, SMALL_CHUNKS)
    await sender.begin(Handshake("r1", LAYOUT))
    await sender.send_layer(KvPool.TARGET, 0, src[KvPool.TARGET].layers[0], SRC_IDS, DST_IDS)
    shared.receiver.release("r1")
    await asyncio.sleep(0.2)  # the receiver ends the call; the sender sees it before writing
    layer = src[KvPool.TARGET].layers[1]
    before = bits(shared.pools[KvPool.TARGET].layers[1][0]).clone()
    with pytest.raises(KvTransferError, match="UNKNOWN_REQUEST: the reservation was released"):
        await sender.send_layer(KvPool.TARGET, 1, layer, SRC_IDS, DST_IDS)
    assert torch.equal(bits(shared.pools[KvPool.TARGET].layers[1][0]), before)
    assert sender.state is TransferState.FAILED


async def test_pools_not_in_the_segment_go_through_the_ring(shared: SharedReceiving) -> None:
    private = make_pools(LAYOUT, DST_SEED)
    shared.receiver.reserve(KvReservation("r1", DST_IDS, private, LAYOUT))
    src = make_pools(LAYOUT, SRC_SEED)
    sender = shm_sender(shared.channel, shared.rings, SMALL_CHUNKS)
    await push_all(sender, "r1", LAYOUT, src)
    await shared.receiver.wait_done("r1", timeout=5)
    assert not sender.is_placed
    assert len(shared.ring_names) == 1
    assert mismatches(private, src, make_pools(LAYOUT, DST_SEED)) == []

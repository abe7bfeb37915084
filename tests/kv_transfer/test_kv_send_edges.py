"""The KV sender's edges, apart from any worker: the receiver refuses a block sent twice,
and a cancelled send returns only once its offloaded copy finished reading the blocks."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
import torch

from kv_transfer import (
    Handshake,
    KvLayout,
    KvPool,
    KvReceiver,
    KvReservation,
    KvTransferError,
    LoopbackTransport,
    TransferOptions,
    TransferState,
)
from kv_transfer.chunking import ChunkedKvSender, Destination
from tandem.v1 import kv_transfer_pb2 as pb
from tests.kv_transfer.kv_pools import DST_IDS, DST_SEED, SRC_IDS, SRC_SEED, layout_for, make_pools


async def test_the_receiver_still_refuses_a_block_sent_twice() -> None:
    """The push never repeats a block (a straddling block waits for the chunk that
    completes it), so the receiver keeps refusing repeats as a broken sender's sign."""
    layout = layout_for(torch.float32)
    src, dst = make_pools(layout, SRC_SEED), make_pools(layout, DST_SEED)
    receiver = KvReceiver()
    pools = {pool.value: cache for pool, cache in dst.items()}
    receiver.reserve(KvReservation("r", DST_IDS, pools, layout))
    sender = LoopbackTransport(receiver).sender()
    await sender.begin(Handshake("r", layout))
    kv = src[KvPool.TARGET].layers[0]
    await sender.send_layer(KvPool.TARGET, 0, kv, SRC_IDS[:2], DST_IDS[:2])
    with pytest.raises(KvTransferError, match=f"target layer 0 block {DST_IDS[1]} repeated"):
        await sender.send_layer(KvPool.TARGET, 0, kv, SRC_IDS[1:3], DST_IDS[1:3])
    assert receiver.state("r") is TransferState.FAILED


class _NullChannel:
    """A channel that drops every chunk."""

    groups_layers = True

    async def open(self, handshake: pb.KvHandshake, layout: KvLayout) -> Destination | None:
        return None

    async def acquire(self, num_bytes: int) -> torch.Tensor:
        return torch.empty(num_bytes, dtype=torch.uint8)

    async def send(self, header: pb.KvChunk, data: torch.Tensor | None) -> None:
        pass

    async def close(self, last: pb.KvChunk) -> pb.KvPushReply:
        return pb.KvPushReply(status=pb.KV_PUSH_STATUS_OK)

    def on_failed(self, status: int, message: str) -> None:
        pass


class _SlowPack(ChunkedKvSender):
    """A chunked sender whose block copies take 0.3 s (in a thread, with offload)."""

    def __init__(self) -> None:
        super().__init__(_NullChannel(), TransferOptions(offload=True))
        self.num_packed = 0

    def _pack(self, *args: Any) -> None:  # type: ignore[override]
        time.sleep(0.3)
        ChunkedKvSender._pack(*args)
        self.num_packed += 1


async def test_a_cancelled_send_returns_after_its_offloaded_copy() -> None:
    """LayerPush.stop frees the blocks once the send returned: an offloaded copy must not
    still be reading them then."""
    layout = layout_for(torch.float32)
    kv = make_pools(layout, SRC_SEED)[KvPool.TARGET].layers[0]
    sender = _SlowPack()
    await sender.begin(Handshake("r", layout))
    task = asyncio.create_task(sender.send_layer(KvPool.TARGET, 0, kv, SRC_IDS, DST_IDS))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert sender.num_packed == 1

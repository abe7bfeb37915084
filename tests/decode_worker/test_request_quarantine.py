"""A request closed while a same-host prefill worker writes its blocks in place: the blocks
stay the request's (not aborted in the engine, still held in the ledger, the request id
not reservable again) until the push has stopped, then are freed exactly once."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
import torch

from decode_worker.request import CloseReason, Holders, RequestHandle
from decode_worker.transitions import DecodeTransitions
from engine.kv_cache import KVCacheParams, PagedKVCache
from kv_transfer import (
    ChunkedKvSender,
    Handshake,
    KvPool,
    KvReceiver,
    KvTransferError,
    SharedKvPools,
    ShmRingPool,
    TransferOptions,
    add_kv_transfer_servicer,
    server_options,
    shm_sender,
)
from ledger.ledger import Ledger, WorkerRole
from ledger.membership import Membership, Timing
from serving.engine_commands import DropRequest
from serving.rpc import Overloaded
from tests.decode_worker.test_request_handle import LAYOUT, _decoding, _Engine, _EngineLoop

OPTIONS = TransferOptions(chunk_bytes=1024, window=2, timeout_s=30)
SRC_IDS = [5, 6]  # the sender's blocks for the reservation's 2-3 (block 1 is cached)


@dataclass
class SharedWorker:
    """Holders whose receiver writes into a shared segment, served over gRPC."""

    holders: Holders
    channel: grpc.aio.Channel
    rings: ShmRingPool
    src: PagedKVCache

    def sender(self) -> ChunkedKvSender:
        return shm_sender(self.channel, self.rings, OPTIONS)

    @property
    def aborts(self) -> list[Any]:
        return self.holders.engine_loop.calls  # type: ignore[attr-defined,no-any-return]


@pytest.fixture
async def worker(ledger: Ledger) -> AsyncIterator[SharedWorker]:
    membership = Membership(
        ledger,
        "d0",
        role=WorkerRole.DECODE,
        address="127.0.0.1:1",
        capacity=8,
        timing=Timing(heartbeat_ms=1000, lease_ms=5000),
    )
    membership.register()
    params = KVCacheParams(2, 2, 8, 4, torch.float32)
    pools = {KvPool.TARGET: PagedKVCache(params, 8, torch.device("cpu"))}
    shared = SharedKvPools.adopt(LAYOUT, {p.value: c for p, c in pools.items()})
    assert shared is not None
    # a grace period far beyond the test: what frees the blocks is the sender's half-close
    receiver = KvReceiver(epoch=membership.epoch, shared_pools=shared, write_grace_s=60.0)
    server = grpc.aio.server(options=server_options())
    add_kv_transfer_servicer(server, receiver)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    loop: Any = _EngineLoop()
    transitions = DecodeTransitions(membership)
    holders = Holders(_Engine(), loop, receiver, LAYOUT, membership, transitions)  # type: ignore[arg-type]
    src = PagedKVCache(params, 8, torch.device("cpu"))
    for k, v in src.layers:
        k.normal_(), v.normal_()
    rings = ShmRingPool.for_options(OPTIONS)
    yield SharedWorker(holders, channel, rings, src)
    await channel.close()
    await server.stop(0)
    rings.close()
    shared.close()


def _decoding_in(worker: SharedWorker) -> RequestHandle:
    """r1 handed to d0, its KV expected in blocks 2-3 of the shared pools."""
    pools = worker.holders.receiver.shared_pools
    assert pools is not None
    return _decoding(worker.holders, pools={KvPool.TARGET: _SharedTarget(pools)})


class _SharedTarget:
    """The target pool's layers as they lie in the shared segment (a PagedPools)."""

    def __init__(self, pools: SharedKvPools) -> None:
        self.layers = [pools.layer(KvPool.TARGET, i) for i in range(2)]


async def _push_first_layer(worker: SharedWorker) -> ChunkedKvSender:
    sender = worker.sender()
    await sender.begin(Handshake("r1", LAYOUT, worker.holders.membership.epoch))
    await sender.send_layer(KvPool.TARGET, 0, worker.src.layers[0], SRC_IDS, [2, 3])
    assert sender.is_placed
    return sender


@pytest.mark.parametrize("reason", [CloseReason.CANCELLED, CloseReason.LEASE_LOST])
async def test_blocks_written_in_place_are_freed_once_the_push_stopped(
    worker: SharedWorker, reason: CloseReason
) -> None:
    h = worker.holders
    handle = _decoding_in(worker)
    sender = await _push_first_layer(worker)

    handle.close(reason)
    assert handle.closed_by is reason and h.handles == {}
    assert h.quarantined == {"r1": handle}
    await asyncio.sleep(0.3)  # the sender is paused between chunks: nothing is freed
    assert worker.aborts == []  # the engine still holds the blocks
    assert h.membership.is_holding("r1") and len(h.membership.ledger.holdings()) == 1
    with pytest.raises(Overloaded, match="still stopping"):
        h.check_new("r1")
    handle.close(CloseReason.ABORTED)  # a second close changes nothing
    assert worker.aborts == []

    with pytest.raises(KvTransferError, match="dropped"):
        await sender.send_layer(KvPool.TARGET, 1, worker.src.layers[1], SRC_IDS, [2, 3])
    for _ in range(100):  # its half-close: freed at once, long before the grace period
        if worker.aborts:
            break
        await asyncio.sleep(0.02)
    assert worker.aborts == [DropRequest("r1")]
    assert not h.membership.is_holding("r1") and h.membership.ledger.holdings() == []
    assert h.quarantined == {}
    h.check_new("r1")  # reservable again
    await asyncio.sleep(0.1)
    assert len(worker.aborts) == 1  # exactly once


async def test_a_request_closed_with_no_push_under_way_is_freed_at_once(
    worker: SharedWorker,
) -> None:
    h = worker.holders
    handle = _decoding_in(worker)
    handle.close(CloseReason.ABORTED)
    assert worker.aborts == [DropRequest("r1")]
    assert h.quarantined == {} and not h.membership.is_holding("r1")


async def test_a_finished_push_frees_at_once_when_the_request_ends(worker: SharedWorker) -> None:
    h = worker.holders
    handle = _decoding_in(worker)
    sender = await _push_first_layer(worker)
    await sender.send_layer(KvPool.TARGET, 1, worker.src.layers[1], SRC_IDS, [2, 3])
    await sender.finish()
    await handle.wait_for_kv(5)
    handle.close(CloseReason.CANCELLED)
    assert worker.aborts == [DropRequest("r1")]
    assert h.quarantined == {}


async def test_a_decode_with_nothing_pushed_waits_for_an_opened_push_to_stop(
    worker: SharedWorker,
) -> None:
    """A first token that ended the request leaves nothing to push, but a push that was
    opened may still write: the Decode waits, and closing it meanwhile keeps the wait."""
    h = worker.holders
    handle = _decoding_in(worker)
    sender = await _push_first_layer(worker)
    decode = asyncio.ensure_future(handle.wait_for_kv(None))
    await asyncio.sleep(0.3)
    assert not decode.done()
    decode.cancel()  # the router ended the stream meanwhile
    handle.close(CloseReason.CANCELLED)
    assert worker.aborts == [] and h.quarantined == {"r1": handle}
    with pytest.raises(KvTransferError, match="dropped"):
        await sender.send_layer(KvPool.TARGET, 1, worker.src.layers[1], SRC_IDS, [2, 3])
    for _ in range(100):
        if worker.aborts:
            break
        await asyncio.sleep(0.02)
    assert worker.aborts == [DropRequest("r1")]
    assert h.quarantined == {}

"""The same-host channel: each block written once into the receiver's shared pools, or, when
the receiver's pools are not shared, chunks through a shared-memory ring.

The handshake names a ring either way (shm_transport.py); the receiver's initial metadata
says which to use (shared_pools.py): "pools", with its pool segment and the push's reserved
block runs, or "ring". The stream carries the rest of the push: chunk headers of placed
chunks (runs, layers, checksum, no data), the last message, and the reply. A placed push
that stops early (refused, fenced by the receiver, aborted) ends with a half-close, not a
cancellation: the receiver then knows that nothing more is written into its blocks.
"""

from __future__ import annotations

import asyncio
import dataclasses

import grpc  # type: ignore[import-untyped]  # no types-grpcio in the dev extra
import torch

from kv_transfer.base import KvLayout, KvTransferError, RunPair
from kv_transfer.chunking import ChunkedKvSender, Destination, Tamper, TransferOptions
from kv_transfer.cuda_ipc import CudaIpcUnavailable, visible_bus_ids
from kv_transfer.grpc_transport import PushStream, grpc_sender
from kv_transfer.shared_pools import (
    BLOCKS_KEY,
    IPC_KEY,
    PLACEMENT_KEY,
    POOLS_KEY,
    PoolDestination,
    SharedKvPools,
)
from kv_transfer.shm_transport import (
    ShmRing,
    ShmRingPool,
    count_wakeups,
    data_offset_for,
    host_id,
    resolve,
    segment_key,
    shm_available,
    until_readable,
)
from kv_transfer.wire import encode_chunk_message
from tandem.v1 import kv_transfer_pb2 as pb

MAX_MAPPED_POOLS = 8  # receivers' pool segments kept mapped by one sender process


class ShmChannel:
    """Same host: places blocks in the receiver's shared pools when it offers them, else
    fills ring slots (every chunk but the last), the receiver copying them out."""

    def __init__(
        self, channel: grpc.aio.Channel, rings: ShmRingPool, options: TransferOptions
    ) -> None:
        if options.chunk_bytes > rings.slot_bytes:
            raise ValueError(f"chunk_bytes: {options.chunk_bytes} exceed the ring's slots")
        self.options = options
        self.stream = PushStream(channel, options)
        self.groups_layers = True
        self.is_placed = False
        self._rings = rings
        self._ring: ShmRing | None = None
        self._num_acquired = 0  # slots handed out (= chunks packed or being packed)
        self._num_consumed = 0  # wake-up bytes read from the receiver
        self._ended: asyncio.Future[None] | None = None  # done when the call ends
        self._closing: asyncio.Task[None] | None = None  # a failed placed push's half-close
        self._gpu: torch.device | None = None  # placed into a GPU's pools (cuda_ipc)
        self._pools: SharedKvPools | None = None  # the receiver's, while this push writes

    async def open(self, handshake: pb.KvHandshake, layout: KvLayout) -> Destination | None:
        ring = self._ring = self._rings.acquire(data_offset_for(layout, self.options.chunk_bytes))
        handshake.shm.CopyFrom(ring.segment())
        if handshake.checksum_kind == pb.CHECKSUM_KIND_SUM64:  # GPU pools may take it
            handshake.cuda_ipc_bus_ids.extend(visible_bus_ids())
        self.stream.start()
        await self.stream.put(pb.KvPushMessage(handshake=handshake).SerializeToString())
        await self.stream.flush()  # the handshake leaves now: the receiver maps meanwhile
        call = self.stream.call
        loop = asyncio.get_running_loop()
        ended = self._ended = loop.create_future()

        def on_done(_: object) -> None:  # grpc may call it from another thread
            if not loop.is_closed():
                loop.call_soon_threadsafe(resolve, ended)

        call.add_done_callback(on_done)
        metadata = dict(await call.initial_metadata() or ())
        if self.stream.is_broken:
            raise await self.stream.failure()
        placement = metadata.get(PLACEMENT_KEY)
        if placement not in ("pools", "cuda_ipc"):
            return None
        try:
            ipc = metadata[IPC_KEY] if placement == "cuda_ipc" else None
            segment = pb.ShmSegment.FromString(metadata[POOLS_KEY])
            pools = _mapped(self._rings, segment, layout, ipc)
            reserved = pb.KvChunk.FromString(metadata[BLOCKS_KEY]).runs
        except (ValueError, OSError, KeyError, CudaIpcUnavailable) as e:
            raise KvTransferError(pb.KV_PUSH_STATUS_INCOMPATIBLE, f"shm pools: {e}") from e
        self.is_placed = True
        self._gpu = pools.device if pools.device.type == "cuda" else None
        pools.use()
        self._pools = pools
        self._release(is_reusable=True)  # not needed: the blocks go in place
        runs = [RunPair(r.first_block_id, r.first_block_id, r.num_blocks) for r in reserved]
        return PoolDestination(
            pools, runs, lambda: not self.stream.is_broken, self.stream.failure, self._stop
        )

    async def acquire(self, num_bytes: int) -> torch.Tensor:
        ring = self._ring
        assert ring is not None
        if num_bytes > ring.data_bytes:
            raise ValueError(f"chunk_bytes: one block ({num_bytes} bytes) exceeds a ring slot")
        index = self._num_acquired
        await self._wait_consumed(ring, index - ring.num_slots + 1)
        self._num_acquired += 1
        return ring.data(index, num_bytes)

    async def send(self, header: pb.KvChunk, data: torch.Tensor | None) -> None:
        if self.stream.is_broken:
            raise await self.stream.failure()  # refused: the reply says why
        if data is None:  # placed: the header alone travels, in the stream
            await self.stream.put(encode_chunk_message(header, memoryview(b"")))
            return
        ring = self._ring
        assert ring is not None
        # data is the slot acquire gave out last: chunks are packed one at a time, in order
        assert header.sequence_number == self._num_acquired - 1
        ring.publish(header, data.numel())

    async def close(self, last: pb.KvChunk) -> pb.KvPushReply:
        try:
            reply = await self.stream.finish(last)
        finally:
            self._done_writing()
        self._release(is_reusable=reply.status == pb.KV_PUSH_STATUS_OK)
        return reply

    def _done_writing(self) -> None:
        """This push writes the receiver's pools no more (idempotent)."""
        pools, self._pools = self._pools, None
        if pools is not None:
            pools.unuse()

    def on_failed(self, status: int, message: str) -> None:
        """A placed push half-closes (in the background): ChunkedKvSender calls this from
        the pushing task, between copies, so nothing is written after; others cancel."""
        self._release(is_reusable=False)
        if self.is_placed and not self.stream.is_broken and self._closing is None:
            self._closing = asyncio.ensure_future(self._half_close())
        elif self._closing is None:
            self.stream.cancel()

    async def _stop(self) -> KvTransferError:
        """The receiver fenced the blocks (it refused or dropped the push): half-closes,
        which it waits for before reusing them, and returns why from its reply."""
        await self._half_close()
        if self.stream.call.cancelled():  # no reply within timeout_s: cancelled here
            return KvTransferError(
                pb.KV_PUSH_STATUS_INCOMPLETE, "shm pools: fenced by the receiver, no reply"
            )
        return await self.stream.failure()

    async def _half_close(self) -> None:
        """Sends what is queued, then half-closes; waits for the call's end (the receiver
        replies once it sees the half-close), then drops the writer task."""
        stream = self.stream
        try:
            if self._gpu is not None:  # copies still queued land before the half-close
                await asyncio.to_thread(torch.cuda.synchronize, self._gpu)
            self._done_writing()
            if not stream.is_broken:
                await stream.flush()
                await stream.call.done_writing()
            async with asyncio.timeout(self.options.timeout_s):
                await stream.call
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError, TimeoutError):
            pass  # the call ended otherwise: its failure says how
        finally:
            self._done_writing()
            stream.cancel()

    def _release(self, *, is_reusable: bool) -> None:
        ring, self._ring = self._ring, None
        if ring is not None:
            self._rings.release(ring, is_reusable=is_reusable)

    async def _wait_consumed(self, ring: ShmRing, num_chunks: int) -> None:
        """Until the receiver consumed ``num_chunks`` chunks: sleeps on the free FIFO (or
        the call's end: a refusal) for at most ``timeout_s`` at a time."""
        assert self._ended is not None
        while self._num_consumed < num_chunks:
            self._num_consumed += count_wakeups(ring.free_fd)
            if self._num_consumed >= num_chunks:
                return
            if self.stream.is_broken:
                raise await self.stream.failure()
            try:
                async with asyncio.timeout(self.options.timeout_s):
                    await until_readable(ring.free_fd, self._ended)
            except TimeoutError:
                raise KvTransferError(
                    pb.KV_PUSH_STATUS_INCOMPLETE, "shm: the receiver stopped consuming chunks"
                ) from None


def _mapped(
    rings: ShmRingPool, segment: pb.ShmSegment, layout: KvLayout, ipc: bytes | None = None
) -> SharedKvPools:
    """The receiver's pool segment (and with ``ipc`` its GPU pools), mapped once per
    sender process (a few kept; one its receiver closed is mapped again, which fails if
    the receiver is gone)."""
    cache = rings.mapped_pools
    for gone in [k for k, pools in cache.items() if not pools.is_open()]:
        # A dead receiver's memory goes with the last mapping: this one. An opened GPU
        # handle closes once no push copies through it.
        cache.pop(gone).drop()
    key = (segment_key(segment), ipc)
    pools = cache.get(key)
    if pools is None or not pools.is_open() or pools.size != segment.size:
        pools = cache[key] = SharedKvPools.attach(segment, layout, ipc)
    cache.move_to_end(key)
    while len(cache) > MAX_MAPPED_POOLS:
        cache.popitem(last=False)[1].drop()
    return pools


def shm_sender(
    channel: grpc.aio.Channel,
    rings: ShmRingPool,
    options: TransferOptions | None = None,
    *,
    tamper: Tamper | None = None,
) -> ChunkedKvSender:
    """A same-host sender: blocks in place in the receiver's shared pools, else the ring."""
    options = options or TransferOptions()
    return ChunkedKvSender(ShmChannel(channel, rings, options), options, tamper)


def make_sender(
    channel: grpc.aio.Channel,
    *,
    peer_host_id: str | None,
    rings: ShmRingPool | None,
    options: TransferOptions | None = None,
    pools_on_gpu: bool = False,
    peer_pools_bus_id: str = "",
) -> ChunkedKvSender:
    """Shared memory when the receiver reports this host's id (and rings are given),
    else plain gRPC. A same-host push from pools on a GPU (``pools_on_gpu``, the
    sender's) into a decode worker's GPU pools that this process sees
    (``peer_pools_bus_id``: ReserveReply.kv_pools_bus_id) checksums with SUM64 where its
    checksum is "auto", so that the receiver takes the blocks in place (CUDA IPC). Any
    other push keeps the fastest host checksum: one that SUM64 would send through the ring
    is summed on the host, at a fifth of XXH3's speed (docs/serving.md)."""
    if rings is not None and peer_host_id == host_id() and shm_available():
        options = options or TransferOptions()
        gpu_to_gpu = pools_on_gpu and peer_pools_bus_id in visible_bus_ids()
        if options.checksum == "auto" and gpu_to_gpu:
            options = dataclasses.replace(options, checksum="sum64")
        return shm_sender(channel, rings, options)
    return grpc_sender(channel, options)

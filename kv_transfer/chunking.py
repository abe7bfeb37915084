"""The one sender: a chunker (chunks, frames, checksums) composed with a channel per transport.

One chunk holds whole layers of one pool for the same block runs (small layers are grouped
up to ``chunk_bytes``) or part of one layer's runs (a large layer is split at block bounds).
Blocks are checksummed as they are copied, while they are in cache (copying.py). A channel
either hands out buffers the chunk is packed into (gRPC messages, shared-memory ring slots)
or, where the receiver's pools are writable here, a ``Destination``: each block is then
copied once, straight into its reserved destination block, and only the header travels.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn, Protocol, TypeVar

import torch

from kv_transfer.base import (
    POOL_TO_WIRE,
    Handshake,
    KvLayout,
    KvPool,
    KvSender,
    KvTransferError,
    RunPair,
    TransferState,
    dtype_name,
    merge_runs,
    split_runs,
)
from kv_transfer.checksum import (
    RunningChecksum,
    Sum64,
    checksum_function,
    checksum_kind,
    running_checksum,
)
from kv_transfer.copying import byte_view, copy_then_hash, pack, pack_runs
from tandem.v1 import kv_transfer_pb2 as pb

T = TypeVar("T")

# Test hook: sees each chunk's data after its checksum was taken, before it leaves.
Tamper = Callable[[int, torch.Tensor], None]


@dataclass(frozen=True)
class TransferOptions:
    chunk_bytes: int = 4 << 20  # KV bytes per chunk (at least one block per chunk)
    window: int = 4  # chunks prepared ahead of the transport (queued writes / shm slots)
    # "auto" (fastest installed), "crc32", "crc32c", "xxh3_64"; "sum64", computed where the
    # blocks lie: what a push from or into a GPU's pools takes (checksum.Sum64)
    checksum: str = "auto"
    timeout_s: float = 120.0  # deadline of one push
    # Progress deadline: a push whose transport moves nothing (no room for a chunk, no
    # chunk taken, no reply) for this long is aborted as stalled.
    stall_s: float = 10.0
    max_message_bytes: int = 64 << 20  # the receiver's limit; bounds the extra tensors
    # Copies and checksums in a worker thread (they release the GIL): overlaps them with
    # the transport where cores are spare; slower on an oversubscribed host (measured).
    offload: bool = False

    def __post_init__(self) -> None:
        if min(self.chunk_bytes, self.window, self.timeout_s, self.stall_s) <= 0:
            raise ValueError(
                f"chunk_bytes, window, timeout_s, stall_s: must be positive, got {self}"
            )
        if self.max_message_bytes < self.chunk_bytes + (64 << 10):
            raise ValueError("max_message_bytes: must exceed chunk_bytes by 64 KiB at least")
        checksum_kind(self.checksum)  # refuses an unknown or missing algorithm


@dataclass
class ChunkSpec:
    """Where a chunk's data goes: layers [layer_start, layer_end) of ``pool``, ``runs``."""

    pool: KvPool
    layer_start: int
    layer_end: int
    runs: list[RunPair]

    def header(self, sequence_number: int, dtype: torch.dtype, checksum: int) -> pb.KvChunk:
        return pb.KvChunk(
            sequence_number=sequence_number,
            layer_start=self.layer_start,
            layer_end=self.layer_end,
            pool=POOL_TO_WIRE[self.pool],
            runs=[
                pb.BlockRun(first_block_id=r.dst_start, num_blocks=r.num_blocks) for r in self.runs
            ],
            dtype=dtype_name(dtype),
            checksum=checksum,
        )


@dataclass
class _Pending:
    spec: ChunkSpec
    buffer: torch.Tensor | None  # uint8, room for max_layers layers; None: placed
    layer_bytes: int
    max_layers: int
    running: RunningChecksum  # of the layers packed so far


class Destination(Protocol):
    """The receiver's pools, writable from here (same process, or a mapped shared segment)."""

    def layer(self, pool: KvPool, layer: int) -> tuple[torch.Tensor, ...]:
        """K and V of a destination layer, each ``[num_blocks, block_size, heads, dim]``."""

    async def check(self, pool: KvPool, layer: int, runs: Sequence[RunPair]) -> None:
        """Raises KvTransferError unless the reservation is live and holds every
        destination block of ``runs``: a sender writes nothing else."""


class Channel(Protocol):
    """How one push's chunks reach the receiver; ``ChunkedKvSender`` drives it."""

    groups_layers: bool  # False: each layer leaves at once as its own chunk(s)

    async def open(self, handshake: pb.KvHandshake, layout: KvLayout) -> Destination | None:
        """Sends the handshake; a Destination when chunks are to be written in place."""

    async def acquire(self, num_bytes: int) -> torch.Tensor:
        """A uint8 buffer of ``num_bytes`` for the next packed chunk."""

    async def send(self, header: pb.KvChunk, data: torch.Tensor | None) -> None:
        """Sends a chunk: ``data`` from ``acquire``, or None for one written in place."""

    async def close(self, last: pb.KvChunk) -> pb.KvPushReply:
        """Sends the last message and returns the receiver's reply."""

    def on_failed(self, status: int, message: str) -> None:
        """Ends the transport's side of a failed or aborted transfer."""


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The raw bytes of ``tensor`` (copied to a contiguous CPU tensor only when needed)."""
    flat = tensor.detach().contiguous().cpu().reshape(-1)
    return flat.view(torch.uint8).numpy().data


def encode_named_tensor(name: str, tensor: torch.Tensor, checksum: int) -> pb.NamedTensor:
    data = tensor_bytes(tensor)
    fn = checksum_function(checksum)
    assert fn is not None
    return pb.NamedTensor(
        name=name,
        dtype=dtype_name(tensor.dtype),
        shape=list(tensor.shape),
        data=bytes(data),
        checksum=fn(data),
    )


class ChunkedKvSender(KvSender):
    """A ``KvSender`` over any channel: packs (or places) layers into checksummed chunks."""

    def __init__(
        self, channel: Channel, options: TransferOptions | None = None, tamper: Tamper | None = None
    ) -> None:
        super().__init__()
        self.channel = channel
        self.options = options or TransferOptions()
        self.checksum_kind = checksum_kind(self.options.checksum)
        self._tamper = tamper
        self._layout: KvLayout | None = None
        self._destination: Destination | None = None
        self._pending: _Pending | None = None
        self._start = 0.0

    @property
    def is_placed(self) -> bool:
        """Whether blocks go straight into the receiver's pools (one copy, no buffer)."""
        return self._destination is not None

    async def begin(self, handshake: Handshake) -> None:
        if self.state is not TransferState.RESERVED:
            raise RuntimeError(f"begin: the transfer is {self.state.value}")
        self._layout = handshake.layout
        self._start = time.perf_counter()
        self.state = TransferState.TRANSFERRING
        wire = handshake.to_wire(self.checksum_kind)
        opened = self.channel.open(wire, handshake.layout)
        self._destination = await self._guard(opened, "opening the push")

    async def send_layer(
        self,
        pool: KvPool,
        layer: int,
        src_cache_layer: tuple[torch.Tensor, ...],
        src_block_ids: Sequence[int],
        dst_block_ids: Sequence[int],
    ) -> None:
        layout = self._active_layout()
        runs = self._check_layer(layout, pool, layer, src_cache_layer, src_block_ids, dst_block_ids)
        if not runs:
            return
        if self._destination is not None:
            await self._guard(self._destination.check(pool, layer, runs), "checking blocks")
        block_bytes = layout.block_bytes(pool)
        layer_bytes = block_bytes * sum(r.num_blocks for r in runs)
        pending = self._pending
        if pending and not (
            pending.spec.pool is pool
            and pending.spec.runs == runs
            and pending.spec.layer_end == layer
            and pending.spec.layer_end - pending.spec.layer_start < pending.max_layers
        ):
            await self._flush()
        if layer_bytes > self.options.chunk_bytes:  # split this layer at block bounds
            for group in split_runs(runs, max(1, self.options.chunk_bytes // block_bytes)):
                spec = ChunkSpec(pool, layer, layer + 1, group)
                running = running_checksum(self.checksum_kind)
                data = await self._copy(spec, None, 0, src_cache_layer, group, running)
                await self._emit(spec, data, running)
            return
        if self._pending is None:
            shape = layout.pool_shape(pool)
            assert shape is not None
            max_layers = min(self.options.chunk_bytes // layer_bytes, shape.num_layers - layer)
            if not self.channel.groups_layers:
                max_layers = 1
            buffer = None
            if self._destination is None:
                room = self.channel.acquire(max_layers * layer_bytes)
                buffer = await self._guard(room, "waiting for room for a chunk")
            self._pending = _Pending(
                ChunkSpec(pool, layer, layer, runs),
                buffer,
                layer_bytes,
                max_layers,
                running_checksum(self.checksum_kind),
            )
        pending = self._pending
        assert pending is not None
        count = pending.spec.layer_end - pending.spec.layer_start
        offset = count * pending.layer_bytes
        await self._copy(
            pending.spec, pending.buffer, offset, src_cache_layer, runs, pending.running, layer
        )
        pending.spec.layer_end += 1
        if count + 1 == pending.max_layers:
            await self._flush()

    async def finish(self, extra_tensors: Mapping[str, torch.Tensor] | None = None) -> None:
        self._active_layout()
        await self._flush()
        extras = [
            encode_named_tensor(name, t, self.checksum_kind)
            for name, t in (extra_tensors or {}).items()
        ]
        last = pb.KvChunk(sequence_number=self.num_chunks_sent, is_last=True, extra_tensors=extras)
        if last.ByteSize() + 64 > self.options.max_message_bytes:
            await self.abort("extra tensors too large")
            raise ValueError(
                f"extra_tensors: {last.ByteSize()} bytes exceed max_message_bytes "
                f"{self.options.max_message_bytes}"
            )
        reply = await self._guard(self.channel.close(last), "waiting for the receiver's reply")
        self.seconds = time.perf_counter() - self._start
        if reply.status != pb.KV_PUSH_STATUS_OK:
            self._fail(reply.status, reply.message or "refused without a message")
        self.state = TransferState.DONE

    async def abort(self, reason: str) -> None:
        if self.state is TransferState.TRANSFERRING:
            self.state, self.message = TransferState.FAILED, f"aborted: {reason}"
            self.seconds = time.perf_counter() - self._start
            self.channel.on_failed(pb.KV_PUSH_STATUS_INCOMPLETE, f"sender aborted: {reason}")

    def _active_layout(self) -> KvLayout:
        if self.state is TransferState.FAILED:
            raise KvTransferError(pb.KV_PUSH_STATUS_INCOMPLETE, self.message)
        if self.state is not TransferState.TRANSFERRING or self._layout is None:
            raise RuntimeError(f"the transfer is {self.state.value}, not transferring")
        return self._layout

    def _check_layer(
        self,
        layout: KvLayout,
        pool: KvPool,
        layer: int,
        kv: tuple[torch.Tensor, ...],
        src_block_ids: Sequence[int],
        dst_block_ids: Sequence[int],
    ) -> list[RunPair]:
        shape = layout.pool_shape(pool)
        if shape is None:
            raise ValueError(f"pool: {pool} is not in the handshake's layout")
        if not 0 <= layer < shape.num_layers:
            raise ValueError(f"layer: {layer} outside 0..{shape.num_layers - 1} of {pool}")
        expected = (layout.block_size, shape.num_kv_heads, shape.head_dim)
        if len(kv) != shape.num_tensors:
            raise ValueError(
                f"src_cache_layer: {len(kv)} pools, the layout has {shape.num_tensors} per layer"
            )
        for t in kv:
            if t.dtype != layout.dtype or tuple(t.shape[1:]) != expected:
                raise ValueError(
                    f"src_cache_layer: {t.dtype} {tuple(t.shape)} does not match the layout "
                    f"({layout.dtype}, [num_blocks, {', '.join(map(str, expected))}])"
                )
        num_blocks = kv[0].shape[0]
        if src_block_ids and not 0 <= min(src_block_ids) <= max(src_block_ids) < num_blocks:
            raise ValueError(f"src_block_ids: outside 0..{num_blocks - 1}")
        return merge_runs(src_block_ids, dst_block_ids)

    async def _copy(
        self,
        spec: ChunkSpec,
        buffer: torch.Tensor | None,
        offset: int,
        kv: tuple[torch.Tensor, ...],
        runs: list[RunPair],
        running: RunningChecksum,
        layer: int | None = None,
    ) -> torch.Tensor | None:
        """Packs ``runs`` into ``buffer`` from ``offset`` (acquired here when None and not
        placed), or places them in the destination; returns the buffer."""
        if self._destination is not None:
            dst = self._destination.layer(spec.pool, spec.layer_start if layer is None else layer)
            await self._offload(self._place, dst, kv, runs, running)
            return None
        if buffer is None:
            num_bytes = self._layout_block_bytes(spec.pool) * _num_blocks(runs)
            buffer = await self._guard(
                self.channel.acquire(num_bytes), "waiting for room for a chunk"
            )
        await self._offload(self._pack, buffer, offset, kv, runs, running)
        return buffer

    def _layout_block_bytes(self, pool: KvPool) -> int:
        assert self._layout is not None
        return self._layout.block_bytes(pool)

    async def _offload(self, fn: Callable[..., T], *args: Any) -> T:
        """Copies and checksums: in a worker thread with ``options.offload``, else inline.
        A cancelled caller waits for the thread: it may be reading pool blocks that are
        freed as soon as the push has stopped."""
        if not self.options.offload:
            return fn(*args)
        work = asyncio.ensure_future(asyncio.to_thread(fn, *args))
        try:
            return await asyncio.shield(work)
        except asyncio.CancelledError:
            await asyncio.wait({work})
            raise

    @staticmethod
    def _pack(
        buffer: torch.Tensor,
        offset: int,
        kv: tuple[torch.Tensor, ...],
        runs: list[RunPair],
        running: RunningChecksum,
    ) -> None:
        """Copies each run's K then V blocks into ``buffer`` from byte ``offset``, adding
        them to ``running`` (so ``offset`` must be where the last pack ended)."""
        dst = byte_view(buffer)
        assert dst is not None, "chunk buffers are contiguous CPU bytes"
        pack_runs(dst[offset:], kv, [(r.src_start, r.num_blocks) for r in runs], running)

    @staticmethod
    def _place(
        dst_kv: tuple[torch.Tensor, ...],
        kv: tuple[torch.Tensor, ...],
        runs: list[RunPair],
        running: RunningChecksum,
    ) -> None:
        """Copies each run's K then V blocks straight into their destination blocks, adding
        them to ``running`` in the order ``_pack`` lays them out (same checksum). Into a
        GPU's pools (CUDA IPC): device copies, checksummed there (SUM64); the checksum's
        ``intdigest``, read before the chunk's header is sent, waits for the copies, so the
        header leaves after its blocks landed."""
        if dst_kv[0].is_cuda:
            if not isinstance(running, Sum64):
                raise ValueError("checksum: a push into GPU pools needs 'sum64'")
            for run in runs:
                src_blocks = slice(run.src_start, run.src_start + run.num_blocks)
                dst_blocks = slice(run.dst_start, run.dst_start + run.num_blocks)
                for src_t, dst_t in zip(kv, dst_kv, strict=True):
                    dst_t[dst_blocks].copy_(src_t[src_blocks], non_blocking=True)
                    running.update_tensor(dst_t[dst_blocks])
            return
        block_bytes = kv[0][0].numel() * kv[0].element_size()
        src_bytes = [byte_view(t) for t in kv]
        dst_bytes = [byte_view(t) for t in dst_kv]
        for run in runs:
            num_bytes = run.num_blocks * block_bytes
            start, dst_start = run.src_start * block_bytes, run.dst_start * block_bytes
            for pool_tensor, src, dst in zip(kv, src_bytes, dst_bytes, strict=True):
                assert dst is not None, "a destination is contiguous CPU memory"
                piece = dst[dst_start : dst_start + num_bytes]
                if src is not None:
                    copy_then_hash(piece, src[start : start + num_bytes], running)
                else:
                    blocks = pool_tensor[run.src_start : run.src_start + run.num_blocks]
                    pack(piece, blocks, running)

    async def _flush(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            num_layers = pending.spec.layer_end - pending.spec.layer_start
            data = None
            if pending.buffer is not None:
                data = pending.buffer[: num_layers * pending.layer_bytes]
            await self._emit(pending.spec, data, pending.running)

    async def _emit(
        self, spec: ChunkSpec, data: torch.Tensor | None, running: RunningChecksum
    ) -> None:
        """Sends a packed or placed chunk; the test hook may tamper with its bytes (a
        placed chunk: its first run's K in the destination) after its checksum."""
        layout = self._active_layout()
        if isinstance(running, Sum64) and running.is_on_device:  # waits for the device,
            digest = await asyncio.to_thread(running.intdigest)  # off the event loop
        else:
            digest = running.intdigest()
        header = spec.header(self.num_chunks_sent, layout.dtype, digest)
        if self._tamper is not None:
            self._tamper(header.sequence_number, data if data is not None else self._placed(spec))
        sent = self.channel.send(header, data)
        await self._guard(sent, f"sending chunk {header.sequence_number}")
        self.num_chunks_sent += 1
        num_blocks = _num_blocks(spec.runs) * (spec.layer_end - spec.layer_start)
        self.num_bytes_sent += (
            data.numel() if data is not None else num_blocks * layout.block_bytes(spec.pool)
        )

    def _placed(self, spec: ChunkSpec) -> torch.Tensor:
        assert self._destination is not None
        run = spec.runs[0]
        k = self._destination.layer(spec.pool, spec.layer_start)[0]
        return k[run.dst_start : run.dst_start + run.num_blocks].reshape(-1).view(torch.uint8)

    async def _guard(self, work: Awaitable[T], what: str) -> T:
        """Runs transport work; a transport failure fails the transfer, and so does work
        that moves nothing for ``options.stall_s`` (a stalled receiver or channel)."""
        try:
            async with asyncio.timeout(self.options.stall_s) as deadline:
                return await work
        except TimeoutError:
            if not deadline.expired():
                raise
            self._fail(pb.KV_PUSH_STATUS_INCOMPLETE, stalled(self.options.stall_s, what))
        except KvTransferError as e:
            self._fail(e.status, e.message)

    def _fail(self, status: int, message: str) -> NoReturn:
        self.state, self.message = TransferState.FAILED, message
        self.seconds = time.perf_counter() - self._start
        self.channel.on_failed(status, message)
        raise KvTransferError(status, message)


def stalled(stall_s: float, what: str) -> str:
    """The message of a push aborted for want of progress."""
    return f"stalled: nothing moved for {stall_s:g} s while {what} (transfer_stall_s)"


def _num_blocks(runs: list[RunPair]) -> int:
    return sum(r.num_blocks for r in runs)

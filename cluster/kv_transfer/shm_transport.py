"""Same-host fast path: chunk data through a shared-memory ring, control over gRPC.

The sender owns a ring (a /dev/shm file: an 8-byte counter, then ``window`` page-aligned
slots of ``chunk_bytes``), copies each chunk into the next slot and sends a KvChunk with
its ``shm_region`` and checksum; the receiver checks and copies it into its pools, then
stores the count of chunks consumed in the counter. The sender reuses a slot only once
the counter shows the chunk before it was consumed. Rings are pre-touched and pooled.

Selection: both ends compute ``host_id()``; when the decode worker's equals the prefill
worker's, ``make_sender`` picks shared memory, else plain gRPC.
No CUDA IPC path yet: GPU pools go through host memory here.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import mmap
import os
import re
import secrets
import socket
import stat
import struct
import time
import weakref
from collections import OrderedDict
from pathlib import Path

import grpc  # type: ignore[import-untyped]  # no types-grpcio in the dev extra
import torch

from cluster.kv_transfer.base import Handshake, KvTransferError
from cluster.kv_transfer.chunking import Tamper, TransferOptions
from cluster.kv_transfer.grpc_transport import GrpcKvSender
from tandem.v1 import kv_transfer_pb2 as pb

SHM_DIR = Path("/dev/shm")
_NAME = re.compile(r"tandem-kv-[A-Za-z0-9_-]{1,64}")
_COUNTER = struct.Struct("<Q")  # chunks the receiver has consumed
_PAGE = mmap.PAGESIZE
HEADER_BYTES = 4096  # the counter (see ShmSegment in the proto), then the slots


@functools.cache
def host_id() -> str:
    """Hostname, boot id, IPC namespace and /dev/shm device: equal only for two processes
    that can open the same shared-memory files."""
    parts = [socket.gethostname()]
    try:
        parts.append(Path("/proc/sys/kernel/random/boot_id").read_text().strip())
    except OSError:
        parts.append("")
    for path in ("/proc/self/ns/ipc", str(SHM_DIR)):
        try:
            st = os.stat(path)
            parts.append(f"{st.st_dev}:{st.st_ino}")
        except OSError:
            parts.append("")
    return "/".join(parts)


def shm_available() -> bool:
    return SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK)


class ShmRing:
    """A mapped ring file; the sender creates (and unlinks) it, the receiver attaches."""

    def __init__(self, name: str, mm: mmap.mmap, inode: int, slot_bytes: int = 0) -> None:
        self.name, self.size, self.inode = name, len(mm), inode
        self.slot_bytes = slot_bytes
        self.num_slots = (self.size - HEADER_BYTES) // slot_bytes if slot_bytes else 0
        self._mm = mm
        self.tensor = torch.frombuffer(mm, dtype=torch.uint8)  # [size]

    @classmethod
    def create(cls, slot_bytes: int, num_slots: int) -> ShmRing:
        slot_bytes = -(-slot_bytes // _PAGE) * _PAGE
        name = f"tandem-kv-{os.getpid()}-{secrets.token_hex(6)}"
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(SHM_DIR / name, flags, 0o600)
        try:
            os.ftruncate(fd, HEADER_BYTES + num_slots * slot_bytes)
            mm = mmap.mmap(fd, HEADER_BYTES + num_slots * slot_bytes)
            inode = os.fstat(fd).st_ino
        except BaseException:
            os.unlink(SHM_DIR / name)
            raise
        finally:
            os.close(fd)
        ring = cls(name, mm, inode, slot_bytes)
        ring.tensor.zero_()  # pre-touch: no page faults during transfers
        return ring

    @classmethod
    def attach(cls, segment: pb.ShmSegment) -> ShmRing:
        if not _NAME.fullmatch(segment.name):
            raise ValueError(f"name {segment.name!r} is not a tandem-kv segment name")
        fd = os.open(SHM_DIR / segment.name, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size != segment.size:
                raise ValueError(
                    f"{segment.name}: {st.st_size} bytes, handshake says {segment.size}"
                )
            if segment.size <= HEADER_BYTES:
                raise ValueError(f"{segment.name}: {segment.size} bytes hold no slot")
            mm = mmap.mmap(fd, segment.size)
        finally:
            os.close(fd)
        return cls(segment.name, mm, st.st_ino)

    def is_linked(self) -> bool:
        try:
            return os.stat(SHM_DIR / self.name).st_ino == self.inode
        except OSError:
            return False

    def slot(self, index: int, num_bytes: int) -> torch.Tensor:
        offset = HEADER_BYTES + (index % self.num_slots) * self.slot_bytes
        return self.tensor[offset : offset + num_bytes]

    def region(self, offset: int, length: int) -> memoryview:
        if not HEADER_BYTES <= offset <= offset + length <= self.size:
            raise ValueError(f"[{offset}, {offset + length}) outside [{HEADER_BYTES}, {self.size})")
        return memoryview(self._mm)[offset : offset + length]

    def consumed(self) -> int:
        return int(_COUNTER.unpack_from(self._mm, 0)[0])

    def mark_consumed(self, num_chunks: int) -> None:
        _COUNTER.pack_into(self._mm, 0, num_chunks)

    def close(self) -> None:
        """Unlinks the file (sender side); the mapping goes with the last reference."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(SHM_DIR / self.name)


class ShmRingPool:
    """The sender's rings: one per transfer in flight, reused after a transfer succeeded.
    Every ring it made is unlinked by ``close``, or at exit, or when the pool is collected
    (a killed process leaves its ``tandem-kv-PID-*`` files behind)."""

    def __init__(self, slot_bytes: int, num_slots: int, max_idle: int = 4) -> None:
        self.slot_bytes, self.num_slots, self.max_idle = slot_bytes, num_slots, max_idle
        self._idle: list[ShmRing] = []
        self._names: set[str] = set()  # every ring not unlinked yet
        self._finalizer = weakref.finalize(self, _unlink_all, self._names)

    @classmethod
    def for_options(cls, options: TransferOptions) -> ShmRingPool:
        return cls(options.chunk_bytes, options.window)

    def acquire(self) -> ShmRing:
        if self._idle:
            ring = self._idle.pop()
        else:
            ring = ShmRing.create(self.slot_bytes, self.num_slots)
            self._names.add(ring.name)
        ring.mark_consumed(0)
        return ring

    def release(self, ring: ShmRing, *, is_reusable: bool) -> None:
        if is_reusable and len(self._idle) < self.max_idle:
            self._idle.append(ring)
        else:
            ring.close()
            self._names.discard(ring.name)

    def close(self) -> None:
        """Unlinks every ring, idle or in use (in use: a receiver that has not mapped it yet
        refuses the push)."""
        self._idle.clear()
        self._finalizer()


def _unlink_all(names: set[str]) -> None:
    for name in names:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(SHM_DIR / name)
    names.clear()


class ShmAttacher:
    """``KvReceiver(attach_segment=ShmAttacher())``: checks the host, maps rings by name
    (a few kept mapped; one whose file was unlinked is dropped)."""

    def __init__(self, max_cached: int = 8) -> None:
        self.max_cached = max_cached
        self._rings: OrderedDict[str, ShmRing] = OrderedDict()

    def __call__(self, segment: pb.ShmSegment) -> ShmRing:
        if segment.host_id != host_id():
            raise ValueError(f"host_id: sender {segment.host_id!r}, this host {host_id()!r}")
        for name in [n for n, r in self._rings.items() if not r.is_linked()]:
            del self._rings[name]
        ring = self._rings.get(segment.name)
        if ring is None or ring.size != segment.size:
            ring = ShmRing.attach(segment)
            self._rings[segment.name] = ring
        self._rings.move_to_end(segment.name)
        while len(self._rings) > self.max_cached:
            self._rings.popitem(last=False)
        return ring


class ShmKvSender(GrpcKvSender):
    """The gRPC sender with chunk data in a ring slot instead of the message."""

    def __init__(
        self,
        channel: grpc.aio.Channel,
        rings: ShmRingPool,
        options: TransferOptions | None = None,
        *,
        tamper: Tamper | None = None,
    ) -> None:
        super().__init__(channel, options, tamper=tamper)
        if self.options.chunk_bytes > rings.slot_bytes:
            raise ValueError(f"chunk_bytes: {self.options.chunk_bytes} exceed the ring's slots")
        self._rings = rings
        self._ring: ShmRing | None = None
        self._num_slots_used = 0

    def _handshake(self, handshake: Handshake) -> pb.KvHandshake:
        hs = super()._handshake(handshake)
        assert self._ring is not None
        hs.shm.CopyFrom(
            pb.ShmSegment(name=self._ring.name, size=self._ring.size, host_id=host_id())
        )
        return hs

    async def _open(self, handshake: Handshake) -> None:
        self._ring = self._rings.acquire()
        await super()._open(handshake)

    async def _acquire(self, num_bytes: int) -> torch.Tensor:
        ring = self._ring
        assert ring is not None
        if num_bytes > ring.slot_bytes:
            raise ValueError(f"chunk_bytes: one block ({num_bytes} bytes) exceeds a ring slot")
        index = self._num_slots_used
        await self._wait_consumed(ring, index - ring.num_slots + 1)
        self._num_slots_used += 1
        return ring.slot(index, num_bytes)

    async def _send_chunk(self, header: pb.KvChunk, data: torch.Tensor) -> None:
        await self._offload(self._seal, header, data)
        header.shm_region.offset = int(data.storage_offset())  # data is a view of the ring
        header.shm_region.length = data.numel()
        await self._put(pb.KvPushMessage(chunk=header).SerializeToString())

    async def _close(self, last: pb.KvChunk) -> pb.KvPushReply:
        reply = await super()._close(last)
        self._release(is_reusable=reply.status == pb.KV_PUSH_STATUS_OK)
        return reply

    def _on_failed(self) -> None:
        super()._on_failed()
        self._release(is_reusable=False)

    def _release(self, *, is_reusable: bool) -> None:
        ring, self._ring = self._ring, None
        if ring is not None:
            self._rings.release(ring, is_reusable=is_reusable)

    async def _wait_consumed(self, ring: ShmRing, num_chunks: int) -> None:
        """Until the receiver consumed ``num_chunks`` chunks: yield once (the writer task
        may owe it the control messages), then poll every millisecond (epoll's resolution)."""
        delay, deadline = 0.0, time.monotonic() + self.options.timeout_s
        while ring.consumed() < num_chunks:
            if self._write_error is not None or self._call.done():
                raise await self._failure()
            if time.monotonic() > deadline:
                raise KvTransferError(
                    pb.KV_PUSH_STATUS_INCOMPLETE, "shm: the receiver stopped consuming chunks"
                )
            await asyncio.sleep(delay)
            delay = 1e-3


def make_sender(
    channel: grpc.aio.Channel,
    *,
    peer_host_id: str | None,
    rings: ShmRingPool | None,
    options: TransferOptions | None = None,
) -> GrpcKvSender:
    """Shared memory when the receiver reports this host's id (and rings are given),
    else plain gRPC."""
    if rings is not None and peer_host_id == host_id() and shm_available():
        return ShmKvSender(channel, rings, options)
    return GrpcKvSender(channel, options)

"""Same-host fast path: chunks through a shared-memory ring, wake-ups through two FIFOs.

The sender owns a ring (a shared-memory file: a reserved page, then ``window`` slots) and
two pipes (``ready``, ``free``). Each chunk but the last goes into the
next slot whole: a fixed slot header (sequence number, data length, header length), the
serialized KvChunk header (runs, layers, checksum), then the data, packed from the pools
in 256 KiB pieces, each added to the running checksum (XXH3 by default) right after it is
copied, while in cache (copying.py). Publishing a chunk is one byte written to ``ready``.
The receiver's event loop watches that pipe (``loop.add_reader``), checks the header,
adds each piece of the slot to its checksum right before copying it into its pools, and
compares the whole chunk's. Consumed chunks are announced by bytes on ``free`` (written
in batches of half the window, and before the receiver waits), which the sender watches
before it reuses a slot. Byte counts are the protocol, not just wake-ups: a byte is
written only after what it announces, the kernel orders the two sides, and a byte
written before the other side starts waiting still wakes it (level-triggered). Nothing
spins or polls: each side sleeps in its event loop until the other's byte comes, and the
two processes overlap across the window (the sender packs chunk i + 1 while the receiver
copies chunk i out).

gRPC carries the rest of the push: the handshake (ShmSegment: the ring's descriptors and
geometry), the last message (is_last, extra tensors) after every chunk in the ring, and
the reply, which is also how a refusal (checksum mismatch, malformed slot, dropped
reservation) reaches the sender, whether it is packing or waiting for a slot.

No file has a name: a ring is a memfd and its wake-ups are pipes, which the receiver opens
as /proc/<sender pid>/fd/<n> and checks by device and inode (``SharedFile``). They live
while a process holds them, so a process killed with SIGKILL leaves nothing behind (named
/dev/shm files did: a killed decode worker's pools stayed in memory until the host
rebooted). Rings are pre-touched, pooled after a push that succeeded and closed otherwise;
the receiver takes one push per ring at a time.

Selection: both ends compute ``host_id()``; when the decode worker's equals the prefill
worker's, ``make_sender`` picks shared memory (shm_channel.py), else plain gRPC. When the
receiver's pools themselves are shared (shared_pools.py) it answers the handshake with
them and the sender writes each block in place instead of through this ring.
No CUDA IPC path yet: GPU pools go through host memory here.
"""

from __future__ import annotations

import asyncio
import functools
import mmap
import os
import socket
import stat
import struct
import weakref
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from google.protobuf.message import DecodeError

from kv_transfer.base import KvLayout, KvPool
from kv_transfer.chunking import TransferOptions
from tandem.v1 import kv_transfer_pb2 as pb

_PAGE = mmap.PAGESIZE
HEADER_BYTES = 4096  # reserved (zero), then the slots: see ShmSegment in the proto
# Each slot starts with: sequence_number, data length, KvChunk header length (then 4 zeros).
SLOT_HEADER = struct.Struct("<QQI4x")
# Wake-up bytes in flight never exceed the slots: keep them within a pipe's 64 KiB.
MAX_SLOTS = 4096
_PIPE_FLAGS = os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC


@functools.cache
def host_id() -> str:
    """Hostname, boot id, pid namespace and user: equal only for two processes that can
    open each other's descriptors through /proc (``SharedFile.open``)."""
    parts = [socket.gethostname()]
    try:
        parts.append(Path("/proc/sys/kernel/random/boot_id").read_text().strip())
    except OSError:
        parts.append("")
    try:
        st = os.stat("/proc/self/ns/pid")
        parts.append(f"{st.st_dev}:{st.st_ino}")
    except OSError:
        parts.append("")
    parts.append(str(os.getuid()))
    return "/".join(parts)


def shm_available() -> bool:
    """Whether this process can make shared files that a peer opens through /proc."""
    return hasattr(os, "memfd_create") and os.path.isdir(f"/proc/{os.getpid()}/fd")


class SharedFile:
    """A descriptor this process holds open for a peer to open as /proc/<pid>/fd/<fd>:
    a memfd (``memory``) or a pipe (``pipe``). Closed by ``close``, or when collected."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        st = os.fstat(fd)
        self.device, self.inode = st.st_dev, st.st_ino
        self._finalizer = weakref.finalize(self, os.close, fd)

    @classmethod
    def memory(cls, label: str, size: int) -> tuple[SharedFile, mmap.mmap]:
        """A new file of ``size`` zero bytes, mapped (pre-touch it before use)."""
        fd = os.memfd_create(label, os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            raise
        return cls(fd), mm

    @classmethod
    def pipe(cls) -> SharedFile:
        """A pipe as one non-blocking descriptor that reads and writes (each end writes its
        wake-up bytes into one pipe and reads the other's from the other pipe)."""
        read_fd, write_fd = os.pipe()
        try:
            fd = os.open(f"/proc/self/fd/{read_fd}", _PIPE_FLAGS)
        finally:
            os.close(read_fd)
            os.close(write_fd)
        return cls(fd)

    def describe(self) -> pb.SharedFd:
        return pb.SharedFd(fd=self.fd, device=self.device, inode=self.inode)

    def close(self) -> None:
        self._finalizer()

    @staticmethod
    def open(
        owner_pid: int, shared: pb.SharedFd, flags: int, is_type: Callable[[int], bool]
    ) -> int:
        """Opens a peer's descriptor; raises ValueError unless it is still the announced
        file (device, inode) and of the expected type (``stat.S_ISREG`` ...)."""
        path = f"/proc/{owner_pid}/fd/{shared.fd}"
        fd = os.open(path, flags | os.O_CLOEXEC)
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != (shared.device, shared.inode) or not is_type(st.st_mode):
            os.close(fd)
            raise ValueError(f"{path} is no longer the announced file")
        return fd

    @staticmethod
    def is_open(owner_pid: int, shared: pb.SharedFd) -> bool:
        """Whether the owner still holds the announced file under that descriptor."""
        try:
            st = os.stat(f"/proc/{owner_pid}/fd/{shared.fd}")
        except OSError:
            return False
        return (st.st_dev, st.st_ino) == (shared.device, shared.inode)


def map_shared(owner_pid: int, shared: pb.SharedFd, size: int) -> mmap.mmap:
    """Maps a peer's memory file of ``size`` bytes; raises ValueError if it is not one."""
    fd = SharedFile.open(owner_pid, shared, os.O_RDWR, stat.S_ISREG)
    try:
        actual = os.fstat(fd).st_size
        if actual != size:
            raise ValueError(f"shared file: {actual} bytes, announced {size}")
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


def segment_key(segment: pb.ShmSegment) -> tuple[int, int, int]:
    """Names a peer's segment while it lives: owner pid, device, inode."""
    return segment.owner_pid, segment.file.device, segment.file.inode


def data_offset_for(layout: KvLayout, chunk_bytes: int) -> int:
    """Where data starts in a slot: past the slot header and the largest KvChunk header a
    chunk of ``layout`` can have (at most one run per block; a run takes 14 bytes, the other
    fields 44)."""
    min_block_bytes = min(
        layout.block_bytes(pool) for pool in KvPool if layout.pool_shape(pool) is not None
    )
    max_runs = max(1, chunk_bytes // min_block_bytes)
    return _round_up(SLOT_HEADER.size + 64 + 16 * max_runs, _PAGE)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _signal(fd: int, count: int = 1) -> None:
    """``count`` wake-up bytes (never blocks: at most MAX_SLOTS bytes are ever unread)."""
    os.write(fd, bytes(count))


def count_wakeups(fd: int) -> int:
    """Reads the wake-up bytes there are now (never more than MAX_SLOTS); how many."""
    try:
        return len(os.read(fd, MAX_SLOTS))
    except BlockingIOError:
        return 0


def resolve(future: asyncio.Future[None]) -> None:
    """Sets ``future``'s result unless it is done already (a waker may fire twice)."""
    if not future.done():
        future.set_result(None)


async def until_readable(fd: int, *wakers: asyncio.Future[Any]) -> None:
    """Until ``fd`` is readable or a waker is done. The selector is level-triggered, so a
    byte written before this call still wakes it: no wake-up is lost."""
    loop = asyncio.get_running_loop()
    waiter = loop.create_future()

    def wake(*_: object) -> None:
        resolve(waiter)

    loop.add_reader(fd, wake)
    for future in wakers:
        future.add_done_callback(wake)
    try:
        await waiter
    finally:
        loop.remove_reader(fd)
        for future in wakers:
            future.remove_done_callback(wake)


class ShmRing:
    """A mapped ring; the sender creates it with its pipes (``create``), the receiver maps
    the sender's (``attach``)."""

    def __init__(
        self,
        mm: mmap.mmap,
        slot_bytes: int,
        data_offset: int,
        owner_pid: int,
        files: tuple[pb.SharedFd, pb.SharedFd, pb.SharedFd],  # ring, ready, free
    ) -> None:
        self.size, self.slot_bytes, self.data_offset = len(mm), slot_bytes, data_offset
        self.owner_pid = owner_pid
        self.file, self.ready, self.free = files
        self.name = f"ring {owner_pid}:{self.file.fd}"  # for messages
        self.num_slots = (self.size - HEADER_BYTES) // slot_bytes
        self.data_bytes = slot_bytes - data_offset  # room for one chunk's data
        self._mm = mm
        self._view = memoryview(mm)
        self.tensor = torch.frombuffer(mm, dtype=torch.uint8)  # [size]
        self._own: list[SharedFile] = []  # the sender's ring file and pipes (create)
        self.ready_fd = self.free_fd = -1  # the sender's pipe descriptors (create)

    @classmethod
    def create(cls, data_bytes: int, num_slots: int, data_offset: int = _PAGE) -> ShmRing:
        """A new ring of ``num_slots`` slots with ``data_bytes`` of data each after
        ``data_offset`` bytes of headers, and its pipes."""
        slot_bytes = data_offset + _round_up(data_bytes, _PAGE)
        file, mm = SharedFile.memory("tandem-kv-ring", HEADER_BYTES + num_slots * slot_bytes)
        ready, free = SharedFile.pipe(), SharedFile.pipe()  # closed when collected, if need be
        files = (file.describe(), ready.describe(), free.describe())
        ring = cls(mm, slot_bytes, data_offset, os.getpid(), files)
        ring._own = [file, ready, free]
        ring.ready_fd, ring.free_fd = ready.fd, free.fd
        ring.tensor.zero_()  # pre-touch: no page faults during transfers
        return ring

    @classmethod
    def attach(cls, segment: pb.ShmSegment) -> ShmRing:
        if not all(segment.HasField(f) for f in ("file", "ready", "free")):
            raise ValueError("a ring needs its file and both pipes")
        if not 1 <= segment.num_slots <= MAX_SLOTS:
            raise ValueError(f"num_slots: {segment.num_slots} outside 1..{MAX_SLOTS}")
        if not SLOT_HEADER.size < segment.data_offset < segment.slot_bytes:
            raise ValueError(
                f"data_offset: {segment.data_offset} outside a slot of {segment.slot_bytes}"
            )
        if segment.size != HEADER_BYTES + segment.num_slots * segment.slot_bytes:
            raise ValueError(
                f"size: {segment.size} bytes is not {HEADER_BYTES} + {segment.num_slots} "
                f"slots of {segment.slot_bytes}"
            )
        mm = map_shared(segment.owner_pid, segment.file, segment.size)
        files = (segment.file, segment.ready, segment.free)
        return cls(mm, segment.slot_bytes, segment.data_offset, segment.owner_pid, files)

    def segment(self) -> pb.ShmSegment:
        return pb.ShmSegment(
            size=self.size,
            host_id=host_id(),
            slot_bytes=self.slot_bytes,
            num_slots=self.num_slots,
            data_offset=self.data_offset,
            owner_pid=self.owner_pid,
            file=self.file,
            ready=self.ready,
            free=self.free,
        )

    def matches(self, segment: pb.ShmSegment) -> bool:
        return (self.size, self.slot_bytes, self.data_offset, self.ready, self.free) == (
            segment.size,
            segment.slot_bytes,
            segment.data_offset,
            segment.ready,
            segment.free,
        )

    def is_open(self) -> bool:
        """Whether the sender still holds this ring (receiver side)."""
        return SharedFile.is_open(self.owner_pid, self.file)

    def data(self, sequence_number: int, num_bytes: int) -> torch.Tensor:
        """Where chunk ``sequence_number``'s data goes: ``[num_bytes]`` uint8 in its slot."""
        if num_bytes > self.data_bytes:
            raise ValueError(f"{num_bytes} bytes exceed a slot's {self.data_bytes}")
        start = self._slot(sequence_number) + self.data_offset
        return self.tensor[start : start + num_bytes]

    def publish(self, header: pb.KvChunk, num_bytes: int) -> None:
        """Writes chunk ``header.sequence_number``'s headers into its slot (its data is
        there already), then its wake-up byte."""
        head = header.SerializeToString()
        if SLOT_HEADER.size + len(head) > self.data_offset:
            raise ValueError(f"a {len(head)}-byte chunk header exceeds the slot's room")
        base = self._slot(header.sequence_number)
        start = base + SLOT_HEADER.size
        self._mm[start : start + len(head)] = head
        SLOT_HEADER.pack_into(self._mm, base, header.sequence_number, num_bytes, len(head))
        _signal(self.ready_fd)

    def read(self, sequence_number: int) -> tuple[pb.KvChunk, memoryview]:
        """Chunk ``sequence_number``'s header and data (a view of the slot); raises
        ValueError for a slot that does not hold it."""
        base = self._slot(sequence_number)
        number, num_bytes, head_bytes = SLOT_HEADER.unpack_from(self._mm, base)
        if number != sequence_number:
            slot = sequence_number % self.num_slots
            raise ValueError(f"slot {slot}: holds chunk {number}, expected {sequence_number}")
        if SLOT_HEADER.size + head_bytes > self.data_offset or num_bytes > self.data_bytes:
            raise ValueError(f"chunk {number}: header {head_bytes} or data {num_bytes} bytes")
        start = base + SLOT_HEADER.size
        try:
            chunk = pb.KvChunk.FromString(self._mm[start : start + head_bytes])  # a copy
        except DecodeError as e:
            raise ValueError(f"chunk {number}: not a KvChunk header: {e}") from e
        if chunk.data:
            raise ValueError(f"chunk {number}: data in the header, not after it")
        start = base + self.data_offset
        return chunk, self._view[start : start + num_bytes]

    def drain(self) -> None:
        """Forgets the wake-up bytes of an earlier push (sender, before reusing it)."""
        while count_wakeups(self.ready_fd) or count_wakeups(self.free_fd):
            pass

    def close(self) -> None:
        """Closes the ring file and pipes (sender side): the memory goes with the last
        mapping, the receiver's included."""
        for file in self._own:
            file.close()
        self._own.clear()
        self.ready_fd = self.free_fd = -1

    def _slot(self, sequence_number: int) -> int:
        return HEADER_BYTES + (sequence_number % self.num_slots) * self.slot_bytes


class ShmRingPool:
    """The sender's rings: one per transfer in flight, reused after a transfer succeeded.
    ``slot_bytes`` is the chunk data a slot holds. Every ring it made is closed by
    ``close`` or when the pool is collected (and by the kernel when the process ends)."""

    def __init__(self, slot_bytes: int, num_slots: int, max_idle: int = 4) -> None:
        if not 1 <= num_slots <= MAX_SLOTS:
            raise ValueError(f"num_slots: {num_slots} outside 1..{MAX_SLOTS}")
        self.slot_bytes, self.num_slots, self.max_idle = slot_bytes, num_slots, max_idle
        self._idle: list[ShmRing] = []
        self._open: set[ShmRing] = set()  # every ring not closed yet
        self._finalizer = weakref.finalize(self, _close_all, self._open)
        # Receivers' pool segments this process mapped, by segment_key (see shm_channel).
        self.mapped_pools: OrderedDict[tuple[tuple[int, int, int], bytes | None], Any] = (
            OrderedDict()
        )

    @classmethod
    def for_options(cls, options: TransferOptions) -> ShmRingPool:
        return cls(options.chunk_bytes, options.window)

    def acquire(self, data_offset: int = _PAGE) -> ShmRing:
        """An idle ring whose slots hold data from ``data_offset``, else a new one."""
        for i, ring in enumerate(self._idle):
            if ring.data_offset == data_offset:
                del self._idle[i]
                ring.drain()
                return ring
        ring = ShmRing.create(self.slot_bytes, self.num_slots, data_offset)
        self._open.add(ring)
        return ring

    def release(self, ring: ShmRing, *, is_reusable: bool) -> None:
        if is_reusable and ring in self._open and len(self._idle) < self.max_idle:
            self._idle.append(ring)
        else:
            ring.close()
            self._open.discard(ring)

    def close(self) -> None:
        """Closes every ring, idle or in use (in use: a receiver that has not mapped it yet
        refuses the push)."""
        for ring in self._idle:
            ring.close()
        self._idle.clear()
        self._finalizer()


def _close_all(rings: set[ShmRing]) -> None:
    for ring in rings:
        ring.close()
    rings.clear()


class RingReader:
    """One push's chunks from an attached ring: the receiver's ChunkSource."""

    def __init__(self, ring: ShmRing, on_close: Callable[[], None]) -> None:
        self._ring = ring
        self._on_close = on_close
        self._ready_fd = SharedFile.open(ring.owner_pid, ring.ready, _PIPE_FLAGS, stat.S_ISFIFO)
        try:
            self._free_fd = SharedFile.open(ring.owner_pid, ring.free, _PIPE_FLAGS, stat.S_ISFIFO)
        except BaseException:
            os.close(self._ready_fd)
            raise
        self._num_published = 0  # wake-up bytes read
        self._num_taken = 0
        self._num_unsignalled = 0  # chunks consumed, not told to the sender yet
        self._batch = max(1, ring.num_slots // 2)

    def next_chunk(self) -> tuple[pb.KvChunk, memoryview] | None:
        if self._num_taken == self._num_published:
            self._num_published += count_wakeups(self._ready_fd)
            if self._num_taken == self._num_published:
                self._signal_consumed()  # before waiting: the sender may be waiting too
                return None
        if self._num_published - self._num_taken > self._ring.num_slots:
            raise ValueError(f"more chunks published than the ring's {self._ring.num_slots} slots")
        chunk = self._ring.read(self._num_taken)
        self._num_taken += 1
        return chunk

    def consumed(self) -> None:
        self._num_unsignalled += 1
        if self._num_unsignalled >= self._batch:
            self._signal_consumed()

    def _signal_consumed(self) -> None:
        if self._num_unsignalled:
            _signal(self._free_fd, self._num_unsignalled)
            self._num_unsignalled = 0

    async def wait(self, until: asyncio.Future[Any]) -> None:
        await until_readable(self._ready_fd, until)

    def close(self) -> None:
        if self._ready_fd >= 0:
            os.close(self._ready_fd)
            os.close(self._free_fd)
            self._ready_fd = self._free_fd = -1
            self._on_close()


class ShmAttacher:
    """``KvReceiver(attach_segment=ShmAttacher())``: checks the host, maps senders' rings
    (a few kept mapped; one its sender closed is dropped), one push per ring at a time."""

    def __init__(self, max_cached: int = 8) -> None:
        self.max_cached = max_cached
        self._rings: OrderedDict[tuple[int, int, int], ShmRing] = OrderedDict()
        self._in_use: set[tuple[int, int, int]] = set()

    def __call__(self, segment: pb.ShmSegment) -> RingReader:
        if segment.host_id != host_id():
            raise ValueError(f"host_id: sender {segment.host_id!r}, this host {host_id()!r}")
        key = segment_key(segment)
        if key in self._in_use:
            raise ValueError(
                f"ring {segment.owner_pid}:{segment.file.fd} is in use by another push"
            )
        for stale in [k for k, r in self._rings.items() if not r.is_open()]:
            del self._rings[stale]
        ring = self._rings.get(key)
        if ring is None or not ring.matches(segment):
            ring = self._rings[key] = ShmRing.attach(segment)
        self._rings.move_to_end(key)
        while len(self._rings) > self.max_cached:
            self._rings.popitem(last=False)
        reader = RingReader(ring, functools.partial(self._in_use.discard, key))
        self._in_use.add(key)
        return reader

"""Same-host fast path: chunks through a shared-memory ring, wake-ups through two FIFOs.

The sender owns a ring (a /dev/shm file: a reserved page, then ``window`` slots) and two
FIFOs beside it (``<ring>-ready``, ``<ring>-free``). Each chunk but the last goes into the
next slot whole: a fixed slot header (sequence number, data length, header length), the
serialized KvChunk header (runs, layers, checksum), then the data, packed from the pools
in 256 KiB pieces, each added to the running checksum (XXH3 by default) right after it is
copied, while in cache (copying.py). Publishing a chunk is one byte written to ``-ready``.
The receiver's event loop watches that FIFO (``loop.add_reader``), checks the header,
adds each piece of the slot to its checksum right before copying it into its pools, and
compares the whole chunk's. Consumed chunks are announced by bytes on ``-free`` (written
in batches of half the window, and before the receiver waits), which the sender watches
before it reuses a slot. Byte counts are the protocol, not just wake-ups: a byte is
written only after what it announces, the kernel orders the two sides, and a byte
written before the other side starts waiting still wakes it (level-triggered). Nothing
spins or polls: each side sleeps in its event loop until the other's byte comes, and the
two processes overlap across the window (the sender packs chunk i + 1 while the receiver
copies chunk i out).

gRPC carries the rest of the push: the handshake (ShmSegment: ring name and geometry), the
last message (is_last, extra tensors) after every chunk in the ring, and the reply, which
is also how a refusal (checksum mismatch, malformed slot, released reservation) reaches
the sender, whether it is packing or waiting for a slot. Rings and FIFOs are created
0600 with O_EXCL / O_NOFOLLOW, pre-touched, pooled after a push that succeeded and
unlinked otherwise; the receiver opens them by a validated name (O_NOFOLLOW, file types
checked), one push per ring at a time.

Selection: both ends compute ``host_id()``; when the decode worker's equals the prefill
worker's, ``make_sender`` picks shared memory (shm_channel.py), else plain gRPC. When the
receiver's pools themselves are shared (shared_pools.py) it answers the handshake with
them and the sender writes each block in place instead of through this ring.
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

SHM_DIR = Path("/dev/shm")
SEGMENT_NAME = re.compile(r"tandem-kv-[A-Za-z0-9_-]{1,64}")
_PAGE = mmap.PAGESIZE
HEADER_BYTES = 4096  # reserved (zero), then the slots: see ShmSegment in the proto
# Each slot starts with: sequence_number, data length, KvChunk header length (then 4 zeros).
SLOT_HEADER = struct.Struct("<QQI4x")
READY, FREE = "-ready", "-free"  # FIFO suffixes: chunks published, chunks consumed
# Wake-up bytes in flight never exceed the slots: keep them within a FIFO's 64 KiB.
MAX_SLOTS = 4096
_FIFO_FLAGS = os.O_RDWR | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC


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


def _paths(name: str) -> list[Path]:
    return [SHM_DIR / name, SHM_DIR / f"{name}{READY}", SHM_DIR / f"{name}{FREE}"]


def _open_fifo(path: Path) -> int:
    fd = os.open(path, _FIFO_FLAGS)
    if not stat.S_ISFIFO(os.fstat(fd).st_mode):
        os.close(fd)
        raise ValueError(f"{path.name} is not a FIFO")
    return fd


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
    """A mapped ring file; the sender creates (and unlinks) it with its FIFOs, the
    receiver attaches to it."""

    def __init__(
        self, name: str, mm: mmap.mmap, inode: int, slot_bytes: int, data_offset: int
    ) -> None:
        self.name, self.size, self.inode = name, len(mm), inode
        self.slot_bytes, self.data_offset = slot_bytes, data_offset
        self.num_slots = (self.size - HEADER_BYTES) // slot_bytes
        self.data_bytes = slot_bytes - data_offset  # room for one chunk's data
        self._mm = mm
        self._view = memoryview(mm)
        self.tensor = torch.frombuffer(mm, dtype=torch.uint8)  # [size]
        self.ready_fd = self.free_fd = -1  # the sender's FIFO ends (create)

    @classmethod
    def create(cls, data_bytes: int, num_slots: int, data_offset: int = _PAGE) -> ShmRing:
        """A new ring of ``num_slots`` slots with ``data_bytes`` of data each after
        ``data_offset`` bytes of headers, and its FIFOs (all 0600)."""
        slot_bytes = data_offset + _round_up(data_bytes, _PAGE)
        size = HEADER_BYTES + num_slots * slot_bytes
        name = f"tandem-kv-{os.getpid()}-{secrets.token_hex(6)}"
        ring_path, ready_path, free_path = _paths(name)
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fds: list[int] = []
        try:
            fd = os.open(ring_path, flags, 0o600)
            try:
                os.ftruncate(fd, size)
                mm = mmap.mmap(fd, size)
                inode = os.fstat(fd).st_ino
            finally:
                os.close(fd)
            for path in (ready_path, free_path):
                os.mkfifo(path, 0o600)  # fails if the name exists, a link included
                fds.append(_open_fifo(path))
        except BaseException:
            for fd in fds:
                os.close(fd)
            _unlink(name)
            raise
        ring = cls(name, mm, inode, slot_bytes, data_offset)
        ring.ready_fd, ring.free_fd = fds
        ring.tensor.zero_()  # pre-touch: no page faults during transfers
        return ring

    @classmethod
    def attach(cls, segment: pb.ShmSegment) -> ShmRing:
        if not SEGMENT_NAME.fullmatch(segment.name):
            raise ValueError(f"name {segment.name!r} is not a tandem-kv segment name")
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
        fd = os.open(SHM_DIR / segment.name, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size != segment.size:
                raise ValueError(
                    f"{segment.name}: {st.st_size} bytes, handshake says {segment.size}"
                )
            mm = mmap.mmap(fd, segment.size)
        finally:
            os.close(fd)
        return cls(segment.name, mm, st.st_ino, segment.slot_bytes, segment.data_offset)

    def segment(self) -> pb.ShmSegment:
        return pb.ShmSegment(
            name=self.name,
            size=self.size,
            host_id=host_id(),
            slot_bytes=self.slot_bytes,
            num_slots=self.num_slots,
            data_offset=self.data_offset,
        )

    def matches(self, segment: pb.ShmSegment) -> bool:
        return (self.size, self.slot_bytes, self.data_offset) == (
            segment.size,
            segment.slot_bytes,
            segment.data_offset,
        )

    def is_linked(self) -> bool:
        try:
            return os.stat(SHM_DIR / self.name).st_ino == self.inode
        except OSError:
            return False

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
        """Unlinks the files and closes the FIFOs (sender side); the mapping goes with the
        last reference."""
        _unlink(self.name)
        for fd in (self.ready_fd, self.free_fd):
            if fd >= 0:
                os.close(fd)
        self.ready_fd = self.free_fd = -1

    def _slot(self, sequence_number: int) -> int:
        return HEADER_BYTES + (sequence_number % self.num_slots) * self.slot_bytes


def _unlink(name: str) -> None:
    for path in _paths(name):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


class ShmRingPool:
    """The sender's rings: one per transfer in flight, reused after a transfer succeeded.
    ``slot_bytes`` is the chunk data a slot holds. Every ring it made is unlinked by
    ``close``, or at exit, or when the pool is collected (a killed process leaves its
    ``tandem-kv-PID-*`` files behind)."""

    def __init__(self, slot_bytes: int, num_slots: int, max_idle: int = 4) -> None:
        if not 1 <= num_slots <= MAX_SLOTS:
            raise ValueError(f"num_slots: {num_slots} outside 1..{MAX_SLOTS}")
        self.slot_bytes, self.num_slots, self.max_idle = slot_bytes, num_slots, max_idle
        self._idle: list[ShmRing] = []
        self._names: set[str] = set()  # every ring not unlinked yet
        self._finalizer = weakref.finalize(self, _unlink_all, self._names)
        # Receivers' pool segments this process mapped, by name (see shm_channel).
        self.mapped_pools: OrderedDict[str, Any] = OrderedDict()

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
        self._names.add(ring.name)
        return ring

    def release(self, ring: ShmRing, *, is_reusable: bool) -> None:
        if is_reusable and ring.name in self._names and len(self._idle) < self.max_idle:
            self._idle.append(ring)
        else:
            ring.close()
            self._names.discard(ring.name)

    def close(self) -> None:
        """Unlinks every ring, idle or in use (in use: a receiver that has not mapped it yet
        refuses the push)."""
        for ring in self._idle:
            ring.close()
        self._idle.clear()
        self._finalizer()


def _unlink_all(names: set[str]) -> None:
    for name in names:
        _unlink(name)
    names.clear()


class RingReader:
    """One push's chunks from an attached ring: the receiver's ChunkSource."""

    def __init__(self, ring: ShmRing, on_close: Callable[[], None]) -> None:
        self._ring = ring
        self._on_close = on_close
        self._ready_fd = _open_fifo(SHM_DIR / f"{ring.name}{READY}")
        try:
            self._free_fd = _open_fifo(SHM_DIR / f"{ring.name}{FREE}")
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
    """``KvReceiver(attach_segment=ShmAttacher())``: checks the host, maps rings by name
    (a few kept mapped; one whose file was unlinked is dropped), one push per ring at a
    time."""

    def __init__(self, max_cached: int = 8) -> None:
        self.max_cached = max_cached
        self._rings: OrderedDict[str, ShmRing] = OrderedDict()
        self._in_use: set[str] = set()

    def __call__(self, segment: pb.ShmSegment) -> RingReader:
        if segment.host_id != host_id():
            raise ValueError(f"host_id: sender {segment.host_id!r}, this host {host_id()!r}")
        if segment.name in self._in_use:
            raise ValueError(f"{segment.name} is in use by another push")
        for name in [n for n, r in self._rings.items() if not r.is_linked()]:
            del self._rings[name]
        ring = self._rings.get(segment.name)
        if ring is None or not ring.matches(segment):
            ring = ShmRing.attach(segment)
            self._rings[segment.name] = ring
        self._rings.move_to_end(segment.name)
        while len(self._rings) > self.max_cached:
            self._rings.popitem(last=False)
        reader = RingReader(ring, functools.partial(self._in_use.discard, segment.name))
        self._in_use.add(segment.name)
        return reader

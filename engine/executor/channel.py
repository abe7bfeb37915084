"""Rank 0's step messages to the other ranks of its host: a ring of slots in one shared
memory file, one writer and ``num_readers`` readers.

- **Slots.** The writer copies a message into the next slot (a longer one spans several)
  and then publishes the slot's number; a reader waits for the number, copies the slot
  out and publishes that it has read it. The writer reuses a slot only once every reader
  has read it. As in ``engine.parallel.shm_collectives``, a number is written after its
  slot's bytes and read before them: x86's store and load ordering (TSO).
- **Waiting.** A reader waits for the next message as long as the engine is idle: it spins
  for a moment, then sleeps in short steps, and leaves when the process that started it
  (rank 0) is gone. The writer waits for a free slot for at most ``timeout_s``, and asks
  ``check_ranks`` (the executor: are the rank processes alive?) while it waits.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import time
from collections.abc import Callable

import torch

LINE = 64  # bytes: one cache line per counter
LABEL = "tandem-tp-steps"
SLOT_HEADER = 32  # int64s: the message's number, its total bytes, this piece's offset, bytes


class RankGone(RuntimeError):
    """The process that sends the steps is gone: this rank has nothing left to do."""


class StepChannel:
    """One mapping of the ring: the writer's (``reader`` None) or reader ``reader``'s."""

    def __init__(
        self,
        mapped: mmap.mmap,
        num_readers: int,
        reader: int | None,
        slot_bytes: int,
        num_slots: int,
        timeout_s: float,
    ) -> None:
        self.num_readers, self.reader = num_readers, reader
        self.slot_bytes, self.num_slots = slot_bytes, num_slots
        self.timeout_s = timeout_s
        self._map = mapped
        buffer = torch.frombuffer(mapped, dtype=torch.uint8)
        counters = buffer[: (1 + num_readers) * LINE].view(torch.int64).view(1 + num_readers, -1)
        self._written = counters[0, :1]  # pieces published
        self._read = counters[1:, 0]  # pieces each reader has copied out
        self._slots = buffer[(1 + num_readers) * LINE :].view(num_slots, SLOT_HEADER + slot_bytes)
        self._count = int(self._written[0]) if reader is None else int(self._read[reader])
        self._messages = 0  # the writer's: messages sent

    @staticmethod
    def num_bytes(num_readers: int, slot_bytes: int, num_slots: int) -> int:
        return (1 + num_readers) * LINE + num_slots * (SLOT_HEADER + slot_bytes)

    @classmethod
    def create(
        cls, num_readers: int, *, slot_bytes: int = 1 << 20, num_slots: int = 4, timeout_s: float
    ) -> tuple[StepChannel, int]:
        """The writer's end, and the memory file's descriptor, which readers open through
        ``/proc/<pid>/fd/<fd>`` (``attach``); it stays open until ``close``."""
        fd = os.memfd_create(LABEL, os.MFD_CLOEXEC)
        os.ftruncate(fd, cls.num_bytes(num_readers, slot_bytes, num_slots))
        mapped = mmap.mmap(fd, cls.num_bytes(num_readers, slot_bytes, num_slots))
        channel = cls(mapped, num_readers, None, slot_bytes, num_slots, timeout_s)
        channel._fd = fd
        return channel, fd

    @classmethod
    def attach(
        cls,
        pid: int,
        fd: int,
        num_readers: int,
        reader: int,
        *,
        slot_bytes: int = 1 << 20,
        num_slots: int = 4,
        timeout_s: float,
    ) -> StepChannel:
        path = f"/proc/{pid}/fd/{fd}"
        if not os.readlink(path).startswith(f"/memfd:{LABEL}"):
            raise OSError(f"{path} is not rank 0's step channel")
        own = os.open(path, os.O_RDWR)
        try:
            mapped = mmap.mmap(own, cls.num_bytes(num_readers, slot_bytes, num_slots))
        finally:
            os.close(own)
        return cls(mapped, num_readers, reader, slot_bytes, num_slots, timeout_s)

    _fd = -1

    # -- the writer --------------------------------------------------------------------

    def send(self, message: torch.Tensor, check_ranks: Callable[[], None]) -> None:
        """Publishes ``message`` (any dtype, on the host) to every reader."""
        data = message.contiguous().view(-1).view(torch.uint8)
        total = data.numel()
        self._messages += 1
        at = 0
        while True:
            piece = data[at : at + self.slot_bytes]
            self._wait_free(check_ranks)
            slot = self._slots[self._count % self.num_slots]
            header = torch.tensor([self._messages, total, at, piece.numel()])
            slot[:SLOT_HEADER].view(torch.int64).copy_(header)
            slot[SLOT_HEADER : SLOT_HEADER + piece.numel()].copy_(piece)
            self._count += 1
            self._written[0] = self._count  # after the slot's bytes
            at += piece.numel()
            if at >= total:
                return

    def _wait_free(self, check_ranks: Callable[[], None]) -> None:
        """Until every reader has read the slot the next piece goes into."""
        oldest = self._count - self.num_slots  # the piece that slot holds
        deadline, spins = None, 0
        while int(self._read.min()) <= oldest:
            spins += 1
            if spins % 64 == 0:
                check_ranks()
                now = time.monotonic()
                deadline = deadline or now + self.timeout_s
                if now > deadline:
                    raise RuntimeError(
                        f"step channel: a rank did not read its step inputs within "
                        f"{self.timeout_s:g} s (read {self._read.tolist()}, written {self._count})"
                    )
                time.sleep(0)

    # -- a reader ----------------------------------------------------------------------

    def receive(self, parent_pid: int) -> torch.Tensor:
        """The next message, as bytes; waits for as long as it takes, unless the process
        ``parent_pid`` (rank 0) is gone (``RankGone``)."""
        assert self.reader is not None
        pieces: list[torch.Tensor] = []
        received, total, first = 0, None, None
        while total is None or received < total:
            self._wait_written(parent_pid)
            slot = self._slots[self._count % self.num_slots]
            number, total, offset, size = slot[:SLOT_HEADER].view(torch.int64).tolist()
            first = number if first is None else first
            if number != first or offset != received:
                raise RuntimeError(
                    f"step channel: message {first} was cut off at byte {received} (the "
                    f"next piece is message {number}'s from byte {offset}); rank 0 failed "
                    "while sending it"
                )
            pieces.append(slot[SLOT_HEADER : SLOT_HEADER + size].clone())
            received += size
            self._count += 1
            self._read[self.reader] = self._count  # after copying the slot out
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)

    def _wait_written(self, parent_pid: int) -> None:
        spins, pause = 0, 0.0
        while int(self._written[0]) <= self._count:
            spins += 1
            if spins < 20_000:  # a step's next message comes within a millisecond or two
                if spins % 64 == 0:
                    time.sleep(0)
                continue
            if spins % 16 == 0 and os.getppid() != parent_pid:
                raise RankGone(f"rank 0 (pid {parent_pid}) is gone")
            pause = min(0.002, pause + 0.0001)  # idle: sleep, a little longer each time
            time.sleep(pause)

    def close(self) -> None:
        self._written = self._read = self._slots = None  # type: ignore[assignment]
        with contextlib.suppress(BufferError):
            self._map.close()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

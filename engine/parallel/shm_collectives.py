"""All-reduce and all-gather through shared memory, for the tensor-parallel ranks of one
host on CPU.

gloo's all-reduce goes through loopback TCP: 1.4 to 1.8 ms for the few kilobytes of a
decode step's activations, two per layer, which made a TP 2 step three times slower than
TP 1 (``bench/parallel.py``, bench/RESULTS.md). Here each rank copies its tensor into its
slot of one shared segment and publishes the call's number in its flag; once every flag
shows it, each rank adds up the slots, in rank order, so that every rank holds the same
sum bit for bit (or, for an all-gather, concatenates them).

- **Reuse.** Each call alternates between two buffers. A rank cannot reuse a buffer while
  another still reads it: reaching its next-but-one call means every rank has finished
  the call in between, and so has read this buffer.
- **Ordering.** A flag is written after its slot's data, and read before the data. That
  relies on x86's ordering of stores and of loads (TSO), so the segment is used on x86
  only, and gloo elsewhere.
- **Timeouts.** A rank that does not arrive within ``timeout_s`` makes the call raise, as
  gloo's timeout does.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import platform
import time

import torch
import torch.distributed as dist

FLAG_BYTES = 64  # one cache line per rank's flag


def is_supported() -> bool:
    return platform.machine() in ("x86_64", "AMD64")


class ShmCollectives:
    """One group's segment: ``size`` ranks, each with two slots of ``slot_bytes``."""

    def __init__(
        self,
        rank: int,
        size: int,
        group: dist.ProcessGroup | None,
        slot_bytes: int,
        timeout_s: float,
    ) -> None:
        self.rank, self.size = rank, size
        self.slot_bytes = slot_bytes
        self.timeout_s = timeout_s
        self.generation = 0
        num_bytes = size * FLAG_BYTES + 2 * size * slot_bytes
        where = torch.zeros(2, dtype=torch.int64)
        fd = -1
        if rank == 0:  # a memory file the others open through /proc
            fd = os.memfd_create("tandem-tp-collectives", os.MFD_CLOEXEC)
            os.ftruncate(fd, num_bytes)
            where = torch.tensor([os.getpid(), fd], dtype=torch.int64)
        dist.broadcast(where, src=0, group=group)
        if rank != 0:
            pid, their_fd = (int(v) for v in where.tolist())
            fd = os.open(f"/proc/{pid}/fd/{their_fd}", os.O_RDWR)
        try:
            self._map = mmap.mmap(fd, num_bytes)
        finally:
            dist.barrier(group=group)  # every rank mapped it: the file may go
            os.close(fd)
        buffer = torch.frombuffer(self._map, dtype=torch.uint8)
        self._flags = buffer[: size * FLAG_BYTES].view(torch.int64).view(size, -1)[:, 0]
        self._slots = buffer[size * FLAG_BYTES :].view(2, size, slot_bytes)

    def fits(self, x: torch.Tensor) -> bool:
        return x.device.type == "cpu" and x.numel() * x.element_size() <= self.slot_bytes

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's ``x``, in place (every rank calls it, alike)."""
        parts = self._exchange(x)
        total = parts[0].clone()
        for r in range(1, self.size):
            total += parts[r]
        x.copy_(total.view_as(x))
        return x

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's ``x`` (all of one shape) concatenated along ``dim``, in rank order."""
        parts = self._exchange(x)
        return torch.cat([parts[r].view_as(x) for r in range(self.size)], dim=dim)

    def _exchange(self, x: torch.Tensor) -> torch.Tensor:
        """Publishes ``x`` and waits for every rank's: ``[size, numel]`` views of them."""
        self.generation += 1
        num_bytes = x.numel() * x.element_size()
        slots = self._slots[self.generation % 2, :, :num_bytes]
        slots[self.rank].copy_(x.contiguous().view(-1).view(torch.uint8))
        self._flags[self.rank] = self.generation  # after the data
        self._wait()
        return slots.view(x.dtype).view(self.size, -1)

    def _wait(self) -> None:
        deadline = None
        spins = 0
        while int(self._flags.min()) < self.generation:
            spins += 1
            if spins % 64 == 0:
                now = time.monotonic()
                deadline = deadline or now + self.timeout_s
                if now > deadline:
                    raise RuntimeError(
                        f"collective {self.generation}: a rank did not arrive within "
                        f"{self.timeout_s:g} s (flags {self._flags.tolist()})"
                    )
                time.sleep(0)  # let a rank on the same core run

    def close(self) -> None:
        self._flags = self._slots = None  # type: ignore[assignment]
        with contextlib.suppress(BufferError):  # a view lives on: it goes with the process
            self._map.close()

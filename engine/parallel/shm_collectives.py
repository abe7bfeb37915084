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
  gloo's timeout does; sooner where ``check_ranks`` (rank 0's: its ranks' processes) finds
  a rank's process ended. A rank that is compiling says so in its flag line
  (``compiling``, set around torch.compile's compilations: ``engine.parallel.group``),
  and the others wait for it up to ``COMPILE_WAIT_S``: under data-parallel attention a
  rank compiles the shapes of its own rows while the others, idle or done, wait in the
  step's next collective, minutes from a cold compile cache. With subgroups (tensor
  parallelism inside data-parallel ranks: ``engine.parallel.group``) a rank may wait for
  one that waits, in another segment, for one that compiles: there any rank's compiling
  counts, so a rank stuck or gone while another compiles is found only after that.
- **Checks.** The segment is used only when every rank runs on this host (the same host
  name and boot id) and opened it; otherwise every rank uses gloo. A call whose byte count
  differs between ranks (ranks out of step) raises rather than reading stale bytes.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import platform
import socket
import time
import zlib
from collections.abc import Callable

import torch
import torch.distributed as dist

FLAG_BYTES = 64  # one cache line per rank: its call's number, its byte counts
LABEL = "tandem-tp-collectives"
CHECK_EVERY_S = 0.1  # how often a wait asks whether the other ranks' processes still run
COMPILE_WAIT_S = 900.0  # the longest a wait lasts for a rank that is compiling


def is_supported() -> bool:
    return platform.machine() in ("x86_64", "AMD64")


def _host_key() -> int:
    """This host's (and boot's) identity: equal on every rank of one machine."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return zlib.crc32(f"{socket.gethostname()}/{boot}".encode())


def _all_true(flag: bool, group: dist.ProcessGroup | None = None) -> bool:
    """Whether ``flag`` holds on every rank of ``group`` (default: every rank; gloo)."""
    held = torch.tensor([int(flag)], dtype=torch.int64)
    dist.all_reduce(held, op=dist.ReduceOp.MIN, group=group)
    return bool(held.item())


def map_shared_file(
    rank: int, label: str, num_bytes: int, group: dist.ProcessGroup | None = None
) -> mmap.mmap | None:
    """One memory file of ``num_bytes`` that every rank of ``group`` (default: every rank)
    maps (a collective): its rank 0 (``rank``: the caller's rank in it) creates it and the
    others open it through ``/proc/<pid>/fd``. None on every rank where one of them could
    not map it; the caller has checked that they share a host. The memory goes with the
    last mapping."""
    where = torch.zeros(3, dtype=torch.int64)
    fd = -1
    if rank == 0:
        fd = os.memfd_create(label, os.MFD_CLOEXEC)
        os.ftruncate(fd, num_bytes)
        where = torch.tensor([os.getpid(), fd, num_bytes], dtype=torch.int64)
    dist.broadcast(where, group=group, group_src=0)
    mapped = None
    try:
        if int(where[2]) != num_bytes:  # ranks out of step: a mapping past the file's end
            raise OSError(
                f"{label}: rank 0 made {int(where[2])} bytes, rank {rank} wants {num_bytes}"
            )
        if rank != 0:
            path = f"/proc/{int(where[0])}/fd/{int(where[1])}"
            if not os.readlink(path).startswith(f"/memfd:{label}"):
                raise OSError(f"{path} is not rank 0's {label}")
            fd = os.open(path, os.O_RDWR)
        mapped = mmap.mmap(fd, num_bytes)
    except OSError:
        mapped = None
    # Every rank mapped it, or none uses it; rank 0's file stays open until then.
    is_mapped = _all_true(mapped is not None, group)
    if fd >= 0:
        os.close(fd)
    if not is_mapped:
        if mapped is not None:
            mapped.close()
        return None
    return mapped


class ShmCollectives:
    """One group's segment: ``size`` ranks, each with two slots of ``slot_bytes``."""

    def __init__(
        self, rank: int, size: int, mapped: mmap.mmap, slot_bytes: int, timeout_s: float
    ) -> None:
        self.rank, self.size = rank, size
        self.slot_bytes = slot_bytes
        self.timeout_s = timeout_s
        # Set where this process started the other ranks: raises if one of them has ended.
        self.check_ranks: Callable[[], None] | None = None
        self.generation = 0
        self._map = mapped
        buffer = torch.frombuffer(mapped, dtype=torch.uint8)
        flags = buffer[: size * FLAG_BYTES].view(torch.int64).view(size, -1)
        # Each call's byte count per buffer, as the data: a rank one call ahead may
        # already have written the next call's.
        self._flags, self._sizes = flags[:, 0], flags[:, 1:3]
        self._compiling = flags[:, 3]  # 1 while the rank compiles (set_compiling)
        # Once the worker has subgroups (engine.parallel.group), in each of its segments:
        # every rank's ``compiling`` flags, in the worker's segment. A rank here may be
        # waiting, in another segment, for a rank that compiles: any rank compiling counts.
        self.worker_compiling: torch.Tensor | None = None
        self._slots = buffer[size * FLAG_BYTES :].view(2, size, slot_bytes)

    @classmethod
    def open(
        cls,
        rank: int,
        size: int,
        slot_bytes: int,
        timeout_s: float,
        group: dist.ProcessGroup | None = None,
    ) -> ShmCollectives | None:
        """The segment every rank of ``group`` (default: every rank; ``rank`` and
        ``size``: in it) maps, or None on every rank (they then use gloo) where one of them
        is on another host or could not map it."""
        keys = [torch.zeros(1, dtype=torch.int64) for _ in range(size)]
        dist.all_gather(keys, torch.tensor([_host_key()], dtype=torch.int64), group=group)
        if not is_supported() or len({int(k.item()) for k in keys}) != 1:
            return None
        num_bytes = size * FLAG_BYTES + 2 * size * slot_bytes
        mapped = map_shared_file(rank, LABEL, num_bytes, group)
        if mapped is None:
            return None
        return cls(rank, size, mapped, slot_bytes, timeout_s)

    @property
    def compiling_flags(self) -> torch.Tensor:
        """Each rank's ``compiling`` flag, as the segment holds it."""
        return self._compiling

    def set_compiling(self, is_compiling: bool) -> None:
        """Tells the other ranks that this one is compiling (their waits last longer)."""
        self._compiling[self.rank] = int(is_compiling)

    def fits(self, x: torch.Tensor) -> bool:
        return x.device.type == "cpu" and x.numel() * x.element_size() <= self.slot_bytes

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's ``x``, in place (every rank calls it, alike)."""
        parts = self._exchange(x)
        total = parts[0] + parts[1]  # a group has at least 2 ranks
        for r in range(2, self.size):
            total += parts[r]
        x.copy_(total.view_as(x))
        return x

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's ``x`` (all of one shape) concatenated along ``dim``, in rank order."""
        parts = self._exchange(x)
        return torch.cat([parts[r].view_as(x) for r in range(self.size)], dim=dim)

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``x`` into every rank's, in place."""
        parts = self._exchange(x)
        if self.rank != 0:
            x.copy_(parts[0].view_as(x))
        return x

    def _exchange(self, x: torch.Tensor) -> torch.Tensor:
        """Publishes ``x`` and waits for every rank's: ``[size, numel]`` views of them."""
        self.generation += 1
        num_bytes = x.numel() * x.element_size()
        slots = self._slots[self.generation % 2, :, :num_bytes]
        slots[self.rank].copy_(x.contiguous().view(-1).view(torch.uint8))
        sizes = self._sizes[:, self.generation % 2]
        sizes[self.rank] = num_bytes
        self._flags[self.rank] = self.generation  # after the data and its size
        self._wait()
        if int(sizes.min()) != num_bytes or int(sizes.max()) != num_bytes:
            raise RuntimeError(
                f"collective {self.generation}: the ranks sent {sizes.tolist()} bytes; "
                "they are out of step"
            )
        return slots.view(x.dtype).view(self.size, -1)

    def _wait(self) -> None:
        deadline = checked = started = None
        spins = 0
        while int(self._flags.min()) < self.generation:
            spins += 1
            if spins % 64 == 0:
                now = time.monotonic()
                started = started or now
                deadline = deadline or now + self.timeout_s
                checked = checked or now
                if self.check_ranks is not None and now - checked > CHECK_EVERY_S:
                    self.check_ranks()  # raises at once where a rank's process has ended
                    checked = now
                if now > deadline and self._is_compiling() and now < started + COMPILE_WAIT_S:
                    deadline = now + self.timeout_s  # not stuck: compiling
                if now > deadline:
                    raise RuntimeError(
                        f"collective {self.generation}: a rank did not arrive within "
                        f"{now - started:.0f} s (flags {self._flags.tolist()})"
                    )
                time.sleep(0)  # let a rank on the same core run

    def _is_compiling(self) -> bool:
        """Whether a rank that has not arrived is compiling (with subgroups: any rank)."""
        if self.worker_compiling is not None:
            return bool((self.worker_compiling != 0).any())
        late = self._flags < self.generation
        return bool((self._compiling[late] != 0).any())

    def close(self) -> None:
        self._flags = self._sizes = self._slots = None  # type: ignore[assignment]
        with contextlib.suppress(BufferError):  # a view lives on: it goes with the process
            self._map.close()

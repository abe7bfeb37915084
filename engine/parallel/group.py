"""The process group of one worker's tensor-parallel ranks (torch.distributed: gloo on CPU,
NCCL on CUDA), and the collectives a sharded layer needs.

Every collective has a deadline, so that a rank that died does not leave the others
waiting for ever: they fail, and the worker with them. A decode step's collectives go
through shared memory on one x86 host (``shm_collectives``), whose deadline is
``timeout_s``: a TP 2 decode step spent 2.5 ms in them, against 44-58 ms through gloo's
loopback TCP (bench/RESULTS.md). The group's own collectives (what the ranks agree on at
start-up, tensors too large for the segment) have ``setup_timeout_s``: ranks may finish
loading a model seconds apart. At size 1 there is no group, and the collectives return
their input.
"""

from __future__ import annotations

import datetime
import functools
import random
import secrets
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from engine.parallel import shm_collectives
from engine.parallel.shard import Shard

DEFAULT_TIMEOUT_S = 10.0  # a dead rank takes its worker down within this (decode steps)
SETUP_TIMEOUT_S = 300.0  # the group's own collectives
SHM_SLOT_BYTES = 8 << 20  # the largest collective through shared memory; larger ones: gloo


@dataclass
class TensorParallelGroup:
    """This rank's place (``shard``) and its group's collectives."""

    shard: Shard
    group: dist.ProcessGroup | None  # None at size 1
    shm: shm_collectives.ShmCollectives | None = None  # the ranks' segment, one x86 host
    device: str = "cpu"  # where the group's own collectives' tensors live (NCCL: CUDA)
    seed_base: int = 0  # rank 0's, agreed at joining: the seeds every rank draws alike

    @classmethod
    def single(cls) -> TensorParallelGroup:
        return cls(Shard(0, 1), None)

    @classmethod
    def join(
        cls,
        rank: int,
        size: int,
        init_method: str,
        *,
        backend: str = "gloo",
        timeout_s: float = DEFAULT_TIMEOUT_S,
        setup_timeout_s: float = SETUP_TIMEOUT_S,
        use_shm: bool = True,
    ) -> TensorParallelGroup:
        """Joins the group of ``size`` ranks that meet at ``init_method`` (``tcp://host:port``
        or ``file://path``); returns when all of them have. ``use_shm``: collectives of
        CPU tensors through shared memory, where every rank is on this x86 host."""
        if size == 1:
            return cls.single()
        dist.init_process_group(
            backend,
            init_method=init_method,
            rank=rank,
            world_size=size,
            timeout=datetime.timedelta(seconds=max(timeout_s, setup_timeout_s)),
        )
        device = f"cuda:{torch.cuda.current_device()}" if backend == "nccl" else "cpu"
        tp = cls(Shard(rank, size), dist.group.WORLD, device=device)
        tp.seed_base = tp.agree(secrets.randbits(63))
        if use_shm and backend == "gloo":
            tp.shm = shm_collectives.ShmCollectives.open(rank, size, SHM_SLOT_BYTES, timeout_s)
        return tp

    @property
    def size(self) -> int:
        return self.shard.size

    # Compiled forwards run the collectives between their graphs (a graph break each),
    # as the eager code they are: flags read on the host, timeouts, gloo's calls.
    @torch.compiler.disable
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's ``x`` (a row-parallel layer's partial outputs), in place."""
        if self.shm is not None and self.shm.fits(x):
            return self.shm.all_reduce(x)
        if self.group is not None:
            dist.all_reduce(x, group=self.group)
        return x

    @torch.compiler.disable
    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's ``x`` concatenated along ``dim``, in rank order (vocabulary-parallel
        logits); all ranks' ``x`` have the same shape."""
        if self.group is None:
            return x
        if self.shm is not None and self.shm.fits(x):
            return self.shm.all_gather(x, dim)
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def agree(self, value: int) -> int:
        """Rank 0's ``value`` on every rank."""
        if self.group is None:
            return value
        held = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.broadcast(held, src=0, group=self.group)
        return int(held.item())

    def agree_min(self, value: int) -> int:
        """The smallest of the ranks' ``value``s, on every rank (KV blocks all can hold)."""
        if self.group is None:
            return value
        held = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(held, op=dist.ReduceOp.MIN, group=self.group)
        return int(held.item())

    def seed_source(self) -> Callable[[], int]:
        """Where the seeds of requests that set none come from: unpredictable ones on one
        device; on several ranks, one sequence every rank draws alike (from the seed rank 0
        picked at joining), so that their requests, added alike, sample alike."""
        if self.group is None:
            return functools.partial(secrets.randbits, 63)
        return functools.partial(random.Random(self.seed_base).getrandbits, 63)

    def close(self) -> None:
        if self.shm is not None:
            self.shm.close()
            self.shm = None
        if self.group is not None and dist.is_initialized():
            dist.destroy_process_group()
            self.group = None

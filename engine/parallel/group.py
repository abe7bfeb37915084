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
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from engine.parallel import shm_collectives
from engine.parallel.shard import Shard, data_parallel_shards

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
    key: int = 0  # this group's key in _GROUPS, for the ops compiled graphs call
    undo_on_close: list[Callable[[], None]] = field(default_factory=list)
    # Its subgroups under data-parallel attention, made once (``split_data_parallel``).
    data_parallel: DataParallelLayout | None = None
    is_subgroup: bool = False  # one of them: it ends with its worker's group

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
        tp.key = next(_KEYS)
        _GROUPS[tp.key] = tp
        if use_shm and backend == "gloo":
            tp.shm = shm_collectives.ShmCollectives.open(rank, size, SHM_SLOT_BYTES, timeout_s)
        if tp.shm is not None:
            tp.undo_on_close.append(_say_when_compiling(tp.shm))
        return tp

    @property
    def size(self) -> int:
        return self.shard.size

    @property
    def heads_shard(self) -> Shard:
        """Which heads this rank holds: its share of the worker's, or under data-parallel
        attention its share of its data-parallel rank's."""
        return self.shard if self.data_parallel is None else self.data_parallel.attention.shard

    def split_data_parallel(self, data_parallel_size: int) -> DataParallelLayout:
        """This worker's ranks as ``data_parallel_size`` data-parallel ranks of
        ``size / data_parallel_size`` tensor-parallel ranks each (``data_parallel_shards``
        numbers them): the subgroups made once, by every rank alike (a collective).
        Without a process group (a shape check before any rank starts) the subgroups
        have none either."""
        if self.data_parallel is not None:
            if self.data_parallel.rows.size != data_parallel_size:
                raise ValueError(
                    f"data_parallel_size: {data_parallel_size}; the ranks were split into "
                    f"{self.data_parallel.rows.size} already"
                )
            return self.data_parallel
        attention, rows = data_parallel_shards(self.shard, data_parallel_size)
        if attention.size == 1:  # no tensor parallelism inside: the rows' group is this one
            layout = DataParallelLayout(TensorParallelGroup.single(), self)
        elif self.group is None:
            layout = DataParallelLayout(TensorParallelGroup(attention, None),
                                        TensorParallelGroup(rows, None))  # fmt: skip
        else:
            layout = DataParallelLayout(
                self._subgroup(attention, [
                    [d * attention.size + t for t in range(attention.size)]
                    for d in range(data_parallel_size)
                ]),
                self._subgroup(rows, [
                    [d * attention.size + t for d in range(data_parallel_size)]
                    for t in range(attention.size)
                ]),
            )  # fmt: skip
        self.data_parallel = layout
        return layout

    def _subgroup(self, shard: Shard, every: list[list[int]]) -> TensorParallelGroup:
        """The group of ``every`` list of ranks that holds this rank (``shard``: its place
        in it), with a shared-memory segment of its own where this group has one. Every
        rank makes every list's group (torch.distributed's rule), in one order."""
        mine = None
        for ranks in every:
            group = dist.new_group(ranks, timeout=datetime.timedelta(seconds=SETUP_TIMEOUT_S))
            if self.shard.rank in ranks:
                mine = group
        assert mine is not None
        sub = TensorParallelGroup(shard, mine, device=self.device, is_subgroup=True)
        sub.key = next(_KEYS)
        _GROUPS[sub.key] = sub
        if self.shm is not None:
            sub.shm = shm_collectives.ShmCollectives.open(
                shard.rank, shard.size, SHM_SLOT_BYTES, self.shm.timeout_s, mine
            )
        if sub.shm is not None:
            assert self.shm is not None
            sub.shm.check_ranks = self.shm.check_ranks
            sub.shm.worker_compiling = self.shm.worker_compiling = self.shm.compiling_flags
            sub.undo_on_close.append(_say_when_compiling(sub.shm))
        return sub

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's ``x`` (a row-parallel layer's partial outputs); in place
        when run eagerly. A compiled forward calls it as one op of its graph."""
        if self.group is None:
            return x
        if torch.compiler.is_compiling():
            out: torch.Tensor = torch.ops.tandem.tp_all_reduce(x, self.key)
            return out
        return self._all_reduce(x)

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's ``x`` concatenated along ``dim``, in rank order (vocabulary-parallel
        logits); all ranks' ``x`` have the same shape."""
        if self.group is None:
            return x
        if torch.compiler.is_compiling():
            out: torch.Tensor = torch.ops.tandem.tp_all_gather(x, self.key, dim)
            return out
        return self._all_gather(x, dim)

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``x`` into every rank's ``x``, in place (a step's inputs, sent inside a
        captured graph: NCCL's broadcast is captured with it)."""
        if self.group is None:
            return x
        if self.shm is not None and self.shm.fits(x):
            return self.shm.broadcast(x)
        dist.broadcast(x, group=self.group, group_src=0)
        return x

    # Never compiled as frames of their own: where a graph breaks around a collective
    # (DeepSeek-V3's experts under data-parallel attention), dynamo would otherwise trace
    # the shared-memory exchange's Python and fail on it. 0.3 us a call eagerly.
    @torch.compiler.disable
    def _all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.shm is not None and self.shm.fits(x):
            return self.shm.all_reduce(x)
        dist.all_reduce(x, group=self.group)
        return x

    @torch.compiler.disable
    def _all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        if self.shm is not None and self.shm.fits(x):
            return self.shm.all_gather(x, dim)
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def agree_min(self, value: int) -> int:
        """The smallest of the ranks' ``value``s, on every rank (KV blocks all can hold)."""
        if self.group is None:
            return value
        held = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(held, op=dist.ReduceOp.MIN, group=self.group)
        return int(held.item())

    def close(self) -> None:
        """Ends the worker's group: its subgroups' segments, its own, the process group."""
        if self.is_subgroup:
            raise RuntimeError("a subgroup ends with its worker's group (close that one)")
        if self.data_parallel is not None:
            for sub in (self.data_parallel.attention, self.data_parallel.rows):
                if sub is not self:
                    sub.close_segment()
            self.data_parallel = None
        self.close_segment()
        if self.group is not None and dist.is_initialized():
            dist.destroy_process_group()
            self.group = None

    def close_segment(self) -> None:
        """Its segment and its key: a subgroup's part of ``close`` (the worker's process
        group ends every subgroup's)."""
        _GROUPS.pop(self.key, None)
        while self.undo_on_close:
            self.undo_on_close.pop()()
        if self.shm is not None:
            self.shm.close()
            self.shm = None


@dataclass(frozen=True)
class DataParallelLayout:
    """One rank's subgroups under data-parallel attention: ``attention``, the ranks that
    run its data-parallel rank's rows, each with its part of the heads and channels (its
    attention, dense layers and vocabulary); ``rows``, the ranks of its tensor-parallel
    rank in every data-parallel rank, over which rows are gathered in data-parallel rank
    order (``rows.shard.rank`` is this rank's data-parallel rank). The experts split over
    the whole worker."""

    attention: TensorParallelGroup
    rows: TensorParallelGroup


def _say_when_compiling(shm: shm_collectives.ShmCollectives) -> Callable[[], None]:
    """Marks this rank as compiling in the segment while torch.compile compiles in this
    process (the others' collectives wait longer for it: ``shm_collectives``); returns
    what stops it."""
    from torch._dynamo.callback import CallbackArgs, callback_handler

    def start(_: CallbackArgs) -> None:
        shm.set_compiling(True)

    def end(_: CallbackArgs) -> None:
        shm.set_compiling(False)

    callback_handler.register_start_callback(start)
    callback_handler.register_end_callback(end)

    def stop() -> None:
        callback_handler.remove_start_callback(start)
        callback_handler.remove_end_callback(end)

    return stop


# The groups of this process, by key: the custom ops below take a key, not the group, so
# that a compiled graph holds them as ops of its own (no graph break per collective, whose
# small graphs cost as much as compiling saved: bench/RESULTS.md).
_GROUPS: dict[int, TensorParallelGroup] = {}
_KEYS = itertools.count(1)


@torch.library.custom_op("tandem::tp_all_reduce", mutates_args=())
def _all_reduce_op(x: torch.Tensor, key: int) -> torch.Tensor:
    return _GROUPS[key]._all_reduce(x.clone())


@_all_reduce_op.register_fake
def _(x: torch.Tensor, key: int) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("tandem::tp_all_gather", mutates_args=())
def _all_gather_op(x: torch.Tensor, key: int, dim: int) -> torch.Tensor:
    return _GROUPS[key]._all_gather(x, dim)


@_all_gather_op.register_fake
def _(x: torch.Tensor, key: int, dim: int) -> torch.Tensor:
    shape = list(x.shape)
    shape[dim] *= _GROUPS[key].size
    return x.new_empty(shape)

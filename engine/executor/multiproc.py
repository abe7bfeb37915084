"""A target split over tensor-parallel ranks: rank 0 in this process, beside the engine
(its scheduler, sampler and drafter, as a driver rank), and ranks 1.. in processes of
their own: fresh interpreters (``python -m engine.rank``), so that nothing of
this process is inherited or pickled, and a script that makes an engine needs no
``if __name__ == "__main__"`` guard (``multiprocessing``'s spawn would import it again).

Each forward, rank 0 first sends its inputs (``engine.executor.inputs``: one int64 tensor)
through the step channel (shared memory, ``engine.executor.channel``), then runs its own
shard; every rank runs the same forward over its shard and KV heads, meeting in the
layers' all-reduces. Only rank 0 reads the logits: sampling, logprobs, penalties and
grammar masks are computed here, on the gathered logits, as on one device. The draft
model, when there is one, runs on rank 0 alone, over the target's hidden states (whole on
every rank after each layer's all-reduce).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from engine.attention.base import AttentionBackend
from engine.executor.channel import StepChannel
from engine.executor.graph_steps import RankGraphs
from engine.executor.inputs import ForwardInputs, KvMove, encode, stop_message
from engine.executor.uniproc import UniprocExecutor
from engine.executor.worker import RankConfig
from engine.kv_cache import PagedKVCache
from engine.models.llama3 import ModelOutputs
from engine.parallel.group import DEFAULT_TIMEOUT_S, TensorParallelGroup
from engine.parallel.shm_collectives import is_supported

logger = logging.getLogger(__name__)

STOP_TIMEOUT_S = 5.0  # for a rank to leave once told to, before it is killed
WATCH_EVERY_S = 0.1  # how often the ranks' processes are looked at


class RankLost(RuntimeError):
    """A rank of a split engine has ended: the engine cannot step again."""


def rank_threads(config: RankConfig) -> int:
    """Each rank's share of the CPU threads: ``num_threads`` (else every core) divided
    among the ranks, at least one."""
    total = config.num_threads or os.cpu_count() or 1
    return max(1, total // (config.tensor_parallel_size * config.data_parallel_size))


class RankGroup:
    """Ranks 1..size-1, each in a process of its own, the channel rank 0 sends them their
    steps through, and this process's place in their group (``tp``: rank 0)."""

    def __init__(
        self,
        tp: TensorParallelGroup,
        channel: StepChannel,
        processes: list[subprocess.Popen[bytes]],
        rendezvous: str,
    ) -> None:
        self.tp, self.channel, self.processes = tp, channel, processes
        self._rendezvous = rendezvous
        self._closed = False
        # Told (on a thread of its own) when a rank's process ends while the group is open.
        self.on_lost: Callable[[str], None] | None = None
        self._watcher = threading.Thread(target=self._watch, name="tp-ranks", daemon=True)
        self._watcher.start()

    @property
    def size(self) -> int:
        return self.tp.size

    @classmethod
    def start(cls, config: RankConfig, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> RankGroup:
        """Spawns ranks 1.. and joins their group as rank 0; returns once all have joined.
        They then load their shards as this process loads rank 0's."""
        size = config.tensor_parallel_size * config.data_parallel_size
        device = torch.device(config.device)
        if dist.is_initialized():  # the group is the process's default one
            raise RuntimeError(
                "tensor_parallel_size: one tensor-parallel engine per process; close the "
                "other one first"
            )
        if not is_supported():
            raise ValueError(
                f"tensor_parallel_size: {size} needs an x86-64 host for now (its step channel "
                f"relies on x86's memory ordering); this one is {platform.machine()}"
            )
        base = device.index or 0  # rank r runs on CUDA device base + r
        if device.type == "cuda" and base + size > torch.cuda.device_count():
            raise ValueError(
                f"tensor_parallel_size: {size} ranks from {device}, but only "
                f"{torch.cuda.device_count()} CUDA devices are visible"
            )
        if device.type == "cuda":
            torch.cuda.set_device(base)
        if device.type == "cpu" and size > (os.cpu_count() or 1):
            logger.warning(
                "tensor_parallel_size: %d ranks on %d CPU cores: ranks will share cores",
                size,
                os.cpu_count(),
            )
        backend = "nccl" if device.type == "cuda" else "gloo"
        # What the other ranks load (their share of the threads): as JSON, nothing pickled.
        rank_config = dataclasses.replace(config, num_threads=rank_threads(config))
        spec = json.dumps(dataclasses.asdict(rank_config))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        rendezvous = tempfile.mkdtemp(prefix="tandem-tp-")
        init_method = f"file://{rendezvous}/store"
        channel: StepChannel | None = None
        processes: list[subprocess.Popen[bytes]] = []
        try:
            channel, fd = StepChannel.create(size - 1, timeout_s=timeout_s)
            for rank in range(1, size):
                command = [sys.executable, "-m", "engine.rank"]
                command += ["--rank", str(rank), "--size", str(size)]
                command += ["--init-method", init_method, "--config", spec]
                command += ["--parent-pid", str(os.getpid()), "--channel-fd", str(fd)]
                command += ["--backend", backend, "--timeout-s", str(timeout_s)]
                processes.append(subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL))
            tp = _join_watching(processes, size, init_method, backend, timeout_s)
        except BaseException:
            _stop(processes, 0.0)
            if channel is not None:
                channel.close()
            shutil.rmtree(rendezvous, ignore_errors=True)
            raise
        group = cls(tp, channel, processes, rendezvous)
        if tp.shm is not None:
            tp.shm.check_ranks = group.check
        atexit.register(group.close)  # an engine never closed: its ranks stop with it
        return group

    def check(self) -> None:
        """Raises ``RankLost`` if a rank's process has ended."""
        why = self._lost()
        if why is not None:
            raise RankLost(why)

    def _lost(self) -> str | None:
        for rank, process in enumerate(self.processes, start=1):
            if process.poll() is not None:
                return (
                    f"tensor-parallel rank {rank} (pid {process.pid}) exited with code "
                    f"{process.returncode}; the engine cannot go on without it"
                )
        return None

    def _watch(self) -> None:
        """Tells ``on_lost`` of the first rank that ends while the group is open, idle or
        not (a step would find it only when it ran)."""
        while not self._closed:
            why = self._lost()
            if why is not None and not self._closed:
                logger.error("%s", why)
                if self.on_lost is not None:
                    self.abandon()
                    self.on_lost(why)
                return
            time.sleep(WATCH_EVERY_S)

    def send(self, message: torch.Tensor) -> None:
        self.channel.send(message, self.check)

    def close(self) -> None:
        """Tells the ranks to stop and waits for them (killing any that do not leave)."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        try:
            if self._lost() is None:
                self.channel.send(stop_message(), self.check)
        except Exception:
            logger.warning("tensor-parallel ranks: could not tell them to stop; killing them")
        finally:
            _stop(self.processes, STOP_TIMEOUT_S)
            self.channel.close()
            self.tp.close()
            shutil.rmtree(self._rendezvous, ignore_errors=True)

    def abandon(self) -> None:
        """Kills the ranks at once and removes the rendezvous: before this process exits
        without closing (a serving worker whose rank ended)."""
        self._closed = True
        _stop(self.processes, 0.0)
        shutil.rmtree(self._rendezvous, ignore_errors=True)


def _join_watching(
    processes: list[subprocess.Popen[bytes]],
    size: int,
    init_method: str,
    backend: str,
    timeout_s: float,
) -> TensorParallelGroup:
    """Rank 0's join, failing at once if a rank's process ends before it joined (it
    would otherwise wait for it as long as the group's set-up timeout)."""
    joined: list[TensorParallelGroup] = []
    failed: list[BaseException] = []

    def join() -> None:
        try:
            joined.append(
                TensorParallelGroup.join(0, size, init_method, backend=backend, timeout_s=timeout_s)
            )
        except BaseException as e:  # handed to the caller
            failed.append(e)

    thread = threading.Thread(target=join, name="tp-join", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(WATCH_EVERY_S)
        for rank, process in enumerate(processes, start=1):
            if thread.is_alive() and process.poll() is not None:
                raise RankLost(
                    f"tensor-parallel rank {rank} (pid {process.pid}) exited with code "
                    f"{process.returncode} before joining its group; its error is above"
                )
    if failed:
        raise failed[0]
    return joined[0]


def _stop(processes: list[subprocess.Popen[bytes]], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for process in processes:
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(max(0.0, deadline - time.monotonic()))
    for process in processes:
        if process.poll() is None:
            process.kill()
            process.wait()


class MultiprocExecutor(UniprocExecutor):
    """Rank 0's forward: the step's inputs to the other ranks, then its own shard's."""

    def __init__(
        self,
        ranks: RankGroup,
        model: nn.Module,
        kv_cache: PagedKVCache,
        backend: AttentionBackend,
        decode_model: nn.Module | None = None,
    ) -> None:
        super().__init__(model, kv_cache, backend, decode_model)
        self.ranks = ranks
        self.graph_peers: RankGraphs = RankGraphs(ranks.send, ranks.tp)
        self._broken: str | None = None  # why a forward failed: the ranks are out of step

    def forward(self, inputs: ForwardInputs, *, compiled: bool = False) -> ModelOutputs:
        with self.in_step():
            lora_step = getattr(self.model, "lora_step", None)  # the runner set it
            if self.graph_peers.active:  # a graph runner's step (engine.executor.graph_steps)
                if lora_step is not None:  # EngineConfig refuses CUDA graphs with adapters
                    raise RuntimeError("a graph runner's step carries no LoRA token groups")
                self.graph_peers.forward(inputs, compiled=compiled)
            else:
                groups, changes = None, []
                if lora_step is not None:
                    groups = (lora_step.lora_grouped_offsets, lora_step.lora_ids)
                    changes = lora_step.take_changes()  # the registry queued them
                message = encode(
                    inputs, compiled=compiled, lora_groups=groups, lora_changes=changes
                )
                self.ranks.send(message)
                if changes:  # the ranks read their parts of adapters: wait for them, within
                    self.ranks.tp.agree_min(1)  # the group's own long timeout
            return super().forward(inputs, compiled=compiled)

    def gather_kv(self, pool: str, slots: torch.Tensor) -> None:
        with self.in_step():
            self.ranks.send(KvMove(pool, False, slots).encode())
            super().gather_kv(pool, slots)

    def scatter_kv(self, pool: str, blocks: torch.Tensor) -> None:
        with self.in_step():
            self.ranks.send(KvMove(pool, True, blocks).encode())
            super().scatter_kv(pool, blocks)

    @contextlib.contextmanager
    def in_step(self) -> Iterator[None]:
        """Around anything the other ranks run alongside (a forward, a split draft's): a
        failure inside leaves them anywhere in it, so no later one can pair with theirs,
        and the engine cannot step again (``RankLost``)."""
        if self._broken is not None:
            raise RankLost(f"an earlier forward failed ({self._broken}); the ranks are out of step")
        try:
            yield
        except BaseException as e:
            self._broken = f"{type(e).__name__}: {e}"
            if isinstance(e, Exception) and not isinstance(e, RankLost):
                raise RankLost(f"a forward failed on rank 0 ({self._broken})") from e
            raise

    def abandon(self) -> None:
        self.ranks.abandon()

    def on_rank_lost(self, fn: Callable[[str], None]) -> None:
        self.ranks.on_lost = fn

    def close(self) -> None:
        self.ranks.close()

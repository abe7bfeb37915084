"""The graph runner's steps (``engine.spec.graph_runner``) over split ranks: each rank
captures its own graph of the same step, and rank 0 tells them which to replay.

A captured graph reads its inputs on the device and runs no host code when replayed, so
rank 0 cannot encode each forward's tensors on the host as eager steps do
(``engine.executor.inputs.encode``). Instead:

- **Once per graph**, while rank 0's step runs (eagerly, or being captured), its forward
  sends the other ranks the graph's ``GraphSignature`` (shapes and host bounds) under a
  number (``encode_define``). They allocate one int64 buffer for its tensors, then run
  it once, or capture it into a CUDA graph alongside rank 0 (its collectives too).
- **Every forward** of such a step starts with one broadcast of rank 0's tensors (``pack``)
  into that buffer: inside the graph, on the device. The other ranks' forward reads
  them there.
- **Each later step** of that graph: rank 0 names it (``encode_run``) before replaying its
  own graph (``replay``); a forward run again eagerly names it itself. Each rank replays
  or reruns its own.

A step may hold several forwards: the target's, then a split draft's (its extend and its
propose, ``engine.spec.split_draft``); each is a graph of its own on the other ranks,
named in order. A split draft's forwards outside the graph runner's steps travel the same
way, defined to run once (``ONCE``).

On CPU nothing is captured: the same messages and broadcast run eagerly every step, so the
protocol is tested there; only the capture itself is CUDA's.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Hashable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from engine.executor.graph_wire import (
    ONCE,
    GraphDefine,
    GraphSignature,
    Signature,
    encode_define,
    encode_run,
    pack,
)
from engine.executor.inputs import ForwardInputs, forward_tensors
from engine.models.llama3 import ModelOutputs
from engine.parallel.group import TensorParallelGroup


class GraphPeers:
    """Rank 0's part of the protocol, for one process (no other ranks: does nothing)."""

    @contextlib.contextmanager
    def step(self, key: Hashable, *, capturing: bool) -> Iterator[None]:
        """Around one run of the graph runner's step of ``key``: eagerly, or captured."""
        yield

    def replay(self, key: Hashable) -> None:
        """Before ``key``'s captured graph replays: its forwards' numbers to the ranks."""

    @property
    def active(self) -> bool:
        return False


NO_PEERS = GraphPeers()


class RankGraphs(GraphPeers):
    """Rank 0's side: sends the messages (``send``) and each forward's broadcasts."""

    def __init__(self, send: Callable[[torch.Tensor], None], tp: TensorParallelGroup) -> None:
        self.send, self.tp = send, tp
        self._ids = itertools.count()
        self._eager: dict[Signature, int] = {}  # signatures the ranks hold, eagerly
        self._captured: dict[Hashable, list[int]] = {}  # per key, its forwards' numbers
        self._key: Hashable | None = None  # the step running now
        self._capturing = False
        self.num_defined = 0  # forwards the ranks were sent to keep (run or captured)
        self.num_named = 0  # later runs or replays of them
        self.num_once = 0  # forwards outside the graph runner's steps, run once

    @contextlib.contextmanager
    def step(self, key: Hashable, *, capturing: bool) -> Iterator[None]:
        self._key, self._capturing = key, capturing
        if capturing:
            self._captured[key] = []
        try:
            yield
        finally:
            self._key, self._capturing = None, False

    @property
    def active(self) -> bool:
        return self._key is not None

    def replay(self, key: Hashable) -> None:
        for graph_id in self._captured[key]:
            self._name(graph_id)

    def forward(self, inputs: ForwardInputs, *, compiled: bool) -> None:
        """Rank 0's part of a graph step's target forward, before its own shard's."""
        self.send_op(GraphSignature.of(inputs, compiled=compiled), [pack(forward_tensors(inputs))])

    def send_op(self, signature: Signature, tensors: list[torch.Tensor]) -> None:
        """The message for one forward of ``signature`` (host code: run while capturing,
        not on replay), then its tensors' broadcasts (``signature.buffers``' order).
        Outside the graph runner's steps, a forward run once."""
        if self._capturing:
            graph_id = next(self._ids)
            self._captured[self._key].append(graph_id)
            self._define(graph_id, signature, capture=True)
        elif not self.active:
            self.send(encode_define(ONCE, signature, capture=False))
            self.num_once += 1
        elif signature in self._eager:
            self._name(self._eager[signature])
        else:
            graph_id = self._eager[signature] = next(self._ids)
            self._define(graph_id, signature, capture=False)
        for x in tensors:
            self.tp.broadcast(x)

    def _name(self, graph_id: int) -> None:
        self.send(encode_run(graph_id))
        self.num_named += 1

    def _define(self, graph_id: int, signature: Signature, *, capture: bool) -> None:
        self.send(encode_define(graph_id, signature, capture=capture))
        self.num_defined += 1


# How a rank runs one kind of forward: (its signature, the buffers its broadcasts fill)
# -> the forward over them.
OpRunner = Callable[[Any, list[torch.Tensor]], Callable[[], None]]


def target_runner(forward: Callable[..., ModelOutputs]) -> OpRunner:
    """The target's forward (``forward``: the rank's executor's) of a ``GraphSignature``."""

    def runner(signature: GraphSignature, buffers: list[torch.Tensor]) -> Callable[[], None]:
        inputs = signature.inputs(buffers[0])

        def run() -> None:
            forward(inputs, compiled=signature.compiled)

        return run

    return runner


@dataclass
class _Graph:
    buffers: list[torch.Tensor]  # what the forward's broadcasts fill
    run: Callable[[], None]  # the forward over them
    cuda_graph: Any = None  # torch.cuda.CUDAGraph once captured


class FollowerGraphs:
    """A rank other than 0: the forwards rank 0 defined, run or replayed when named.
    ``runners``: how to run each kind of signature (by its class)."""

    def __init__(
        self,
        runners: Mapping[type, OpRunner],
        tp: TensorParallelGroup,
        device: torch.device,
    ) -> None:
        self.runners, self.tp, self.device = runners, tp, device
        self.graphs: dict[int, _Graph] = {}
        self.pool: Any = None  # the captured graphs' memory pool, as rank 0's

    def define(self, message: GraphDefine) -> None:
        signature = message.signature
        buffers = signature.buffers(self.device)
        graph = _Graph(buffers, self.runners[type(signature)](signature, buffers))
        if message.graph_id != ONCE:
            self.graphs[message.graph_id] = graph
        if not message.capture:
            self._run(graph)
            return
        cuda_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(cuda_graph, pool=self.pool):
            self._run(graph)
        if self.pool is None:
            self.pool = cuda_graph.pool()
        graph.cuda_graph = cuda_graph

    def run(self, graph_id: int) -> None:
        graph = self.graphs[graph_id]
        if graph.cuda_graph is not None:
            graph.cuda_graph.replay()
        else:
            self._run(graph)

    @torch.inference_mode()
    def _run(self, graph: _Graph) -> None:
        for x in graph.buffers:
            self.tp.broadcast(x)
        graph.run()

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

On CPU nothing is captured: the same messages and broadcast run eagerly every step, so the
protocol is tested there; only the capture itself is CUDA's.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from engine.executor.inputs import (
    ForwardInputs,
    GraphDefine,
    GraphSignature,
    encode_define,
    encode_run,
    pack,
)
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
    """Rank 0's side: sends the messages (``send``) and each forward's broadcast."""

    def __init__(self, send: Callable[[torch.Tensor], None], tp: TensorParallelGroup) -> None:
        self.send, self.tp = send, tp
        self._ids = itertools.count()
        self._eager: dict[GraphSignature, int] = {}  # signatures the ranks hold, eagerly
        self._captured: dict[Hashable, list[int]] = {}  # per key, its forwards' numbers
        self._key: Hashable | None = None  # the step running now
        self._capturing = False
        self.num_defined = 0  # graphs the ranks were sent (run once or captured)
        self.num_named = 0  # later runs or replays of them

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

    def _name(self, graph_id: int) -> None:
        self.send(encode_run(graph_id))
        self.num_named += 1

    def _define(self, graph_id: int, signature: GraphSignature, *, capture: bool) -> None:
        self.send(encode_define(graph_id, signature, capture=capture))
        self.num_defined += 1

    def forward(self, inputs: ForwardInputs, *, compiled: bool) -> None:
        """Rank 0's part of one forward of a graph step, before its own shard's: the
        message (host code: run while capturing, not on replay), then the broadcast."""
        signature = GraphSignature.of(inputs, compiled=compiled)
        if self._capturing:
            graph_id = next(self._ids)
            self._captured[self._key].append(graph_id)
            self._define(graph_id, signature, capture=True)
        elif signature in self._eager:
            self._name(self._eager[signature])
        else:
            graph_id = self._eager[signature] = next(self._ids)
            self._define(graph_id, signature, capture=False)
        self.tp.broadcast(pack(inputs))


@dataclass
class _Graph:
    inputs: ForwardInputs  # views of ``packed``
    packed: torch.Tensor  # the broadcast's buffer
    compiled: bool
    cuda_graph: Any = None  # torch.cuda.CUDAGraph once captured


class FollowerGraphs:
    """A rank other than 0: the graphs rank 0 defined, run or replayed when named."""

    def __init__(
        self,
        forward: Callable[..., ModelOutputs],  # the rank's executor's forward
        tp: TensorParallelGroup,
        device: torch.device,
    ) -> None:
        self.forward, self.tp, self.device = forward, tp, device
        self.graphs: dict[int, _Graph] = {}
        self.pool: Any = None  # the captured graphs' memory pool, as rank 0's

    def define(self, message: GraphDefine) -> None:
        signature = message.signature
        packed = torch.zeros(signature.numel, dtype=torch.int64, device=self.device)
        graph = _Graph(signature.inputs(packed), packed, signature.compiled)
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
        self.tp.broadcast(graph.packed)
        self.forward(graph.inputs, compiled=graph.compiled)

"""The graph runner's steps over split ranks, message by message (engine/executor/
graph_steps.py, graph_wire.py): a graph's signature travels once and names the same
shapes, bounds and host lengths on the other side; its tensors travel packed, and unpack
into views of one buffer; rank 0 defines a signature once, then names it; a captured
step's forwards are named again, in order, before each replay; outside the graph
runner's steps a forward is defined to run once. The ranks' side runs what it is named.
Two ranks in real processes: tests/engine/parallel/test_tp_graphs.py."""

from __future__ import annotations

import pytest
import torch

from engine.attention.base import BatchLayout
from engine.executor.graph_steps import FollowerGraphs, RankGraphs, target_runner
from engine.executor.graph_wire import (
    ONCE,
    GraphDefine,
    GraphRun,
    GraphSignature,
    decode_message,
    encode_define,
    encode_run,
    pack,
)
from engine.executor.inputs import (
    MESSAGE_FORMAT,
    ForwardInputs,
    ForwardStep,
    encode,
    forward_tensors,
)
from engine.models.llama3 import ReturnHiddenStates
from engine.parallel.group import TensorParallelGroup

CPU = torch.device("cpu")


def verify_inputs(b: int, s: int, first: int) -> ForwardInputs:
    """A speculative verification's forward: ``b`` rows of ``s`` tokens at ``first``.."""
    positions = torch.arange(first, first + s).repeat(b, 1) + torch.arange(b)[:, None]
    tables = torch.arange(b * 4).view(b, 4)
    layout = BatchLayout.uniform(positions, tables, 4, 16)
    tokens = torch.arange(100, 100 + b * s)
    hidden = ReturnHiddenStates((0, 1), final=True)
    return ForwardInputs(tokens, layout, torch.arange(b * s), hidden)


def tensors(inputs: ForwardInputs) -> list[torch.Tensor]:
    return forward_tensors(inputs)


def decode(message: torch.Tensor, device: torch.device) -> object:
    return decode_message(message, device)


def test_a_signature_travels_once_and_its_tensors_unpack_as_sent() -> None:
    sent = verify_inputs(3, 4, 5)
    signature = GraphSignature.of(sent, compiled=True)
    got = decode(encode_define(7, signature, capture=True), CPU)
    assert got == GraphDefine(7, signature, capture=True)
    assert decode(encode_run(7), CPU) == GraphRun(7)
    [buffer] = signature.buffers(CPU)
    assert buffer.numel() == sum(x.numel() for x in tensors(sent))
    received = signature.inputs(pack(tensors(sent)).clone())
    for mine, theirs in zip(tensors(received), tensors(sent), strict=True):
        assert torch.equal(mine, theirs)
    layout = received.layout
    assert (layout.block_size, layout.max_query_len, layout.max_context_len) == (4, 4, 16)
    assert not layout.is_max_context_exact and layout.query_lens is None
    assert received.return_hidden_states == ReturnHiddenStates((0, 1), final=True)
    # Another batch size or bound is another signature: another graph.
    assert GraphSignature.of(verify_inputs(2, 4, 5), compiled=True) != signature
    # An eager forward's message still carries its values.
    step = decode(encode(sent, compiled=False), CPU)
    assert isinstance(step, ForwardStep) and torch.equal(step.inputs.tokens, sent.tokens)
    assert step.lora_groups is None
    # With LoRA adapters, the forward's token groups travel too (engine.lora).
    groups = ([0, 3, 5, 8], [1, -1, 0])
    step = decode(encode(sent, compiled=False, lora_groups=groups), CPU)
    assert isinstance(step, ForwardStep) and step.lora_groups == groups
    assert step.lora_changes == []
    # And the adapters rank 0 put in or took out since its last forward, names and paths
    # in UTF-8 (digests up to 2**63 - 1).
    changes = [(2, "é-adapter", "/tmp/ä/x", 2**63 - 1), (0, None, "", 0), (1, "", "p", 5)]
    step = decode(encode(sent, compiled=False, lora_groups=groups, lora_changes=changes), CPU)
    assert isinstance(step, ForwardStep) and step.lora_changes == changes


def test_host_lengths_travel_and_what_cannot_is_refused() -> None:
    ragged = verify_inputs(2, 3, 0)
    ragged.layout.query_lens, ragged.layout.context_lens_host = [3, 3], [3, 4]
    signature = GraphSignature.of(ragged, compiled=False)
    assert decode(encode_define(ONCE, signature, capture=False), CPU) == GraphDefine(
        ONCE, signature, capture=False
    )
    layout = signature.inputs(pack(tensors(ragged))).layout
    assert (layout.query_lens, layout.context_lens_host) == ([3, 3], [3, 4])
    ragged.on_layer = print
    with pytest.raises(ValueError, match="no per-layer hook"):
        GraphSignature.of(ragged, compiled=False)
    with pytest.raises(ValueError, match="unknown op 9"):
        decode(torch.tensor([MESSAGE_FORMAT, 9]), CPU)
    with pytest.raises(ValueError, match="unknown forward kind 7"):
        decode(torch.tensor([MESSAGE_FORMAT, 3, 0, 0, 7]), CPU)
    older = MESSAGE_FORMAT - 1
    with pytest.raises(
        ValueError, match=f"step message format {older}, this rank reads {MESSAGE_FORMAT}"
    ):
        decode(torch.tensor([older, 4, 0]), CPU)


def test_rank_0_defines_each_signature_once_then_names_it() -> None:
    messages: list[object] = []
    peers = RankGraphs(lambda m: messages.append(decode(m, CPU)), TensorParallelGroup.single())
    small, large = verify_inputs(1, 4, 3), verify_inputs(2, 4, 3)
    assert not peers.active
    for inputs in (small, small, large, small):
        with peers.step("eager", capturing=False):
            assert peers.active
            peers.forward(inputs, compiled=True)
    s_small = GraphSignature.of(small, compiled=True)
    s_large = GraphSignature.of(large, compiled=True)
    assert messages == [
        GraphDefine(0, s_small, capture=False),
        GraphRun(0),
        GraphDefine(1, s_large, capture=False),
        GraphRun(0),
    ]
    messages.clear()
    # Captured: a step's forwards (here two) each defined afresh, then named at each replay.
    with peers.step("key", capturing=True):
        peers.forward(small, compiled=True)
        peers.forward(large, compiled=True)
    peers.replay("key")
    peers.replay("key")
    assert messages == [
        GraphDefine(2, s_small, capture=True),
        GraphDefine(3, s_large, capture=True),
        GraphRun(2),
        GraphRun(3),
        GraphRun(2),
        GraphRun(3),
    ]
    assert (peers.num_defined, peers.num_named) == (4, 6)
    messages.clear()
    peers.forward(small, compiled=True)  # outside the graph runner's steps: run once
    assert messages == [GraphDefine(ONCE, s_small, capture=False)] and peers.num_once == 1


def test_the_other_ranks_run_what_they_are_named() -> None:
    ran: list[tuple[list[int], bool]] = []

    def forward(inputs: ForwardInputs, *, compiled: bool) -> None:
        ran.append((inputs.tokens.tolist(), compiled))

    runners = {GraphSignature: target_runner(forward)}
    graphs = FollowerGraphs(runners, TensorParallelGroup.single(), CPU)
    signature = GraphSignature.of(verify_inputs(1, 2, 0), compiled=False)
    graphs.define(GraphDefine(4, signature, capture=False))  # run now, on its buffer
    assert ran == [([0, 0], False)]
    graphs.graphs[4].buffers[0][:2] = torch.tensor([8, 9])  # as a broadcast fills it
    graphs.run(4)
    assert ran[-1] == ([8, 9], False)
    graphs.define(GraphDefine(ONCE, signature, capture=False))  # run, not kept
    assert len(ran) == 3 and list(graphs.graphs) == [4]
    with pytest.raises(KeyError):
        graphs.run(5)

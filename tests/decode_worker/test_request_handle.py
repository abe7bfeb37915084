"""A decode worker's request handle: ``close(reason)`` frees the request in the engine,
the KV receiver and the ledger (a real Redis), records how it ended, and fails a running
stream where the reason says so; only the first close acts."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch

from decode_worker.request import Aborted, CloseReason, DeltaSlot, Holders, RequestHandle
from decode_worker.transitions import DecodeTransitions
from engine.kv_cache import KVCacheParams, PagedKVCache
from engine.output_processor import OutputBuilder
from engine.outputs import RequestStart
from engine.sampling_params import SamplingParams
from kv_transfer import KvLayout, KvPool, KvReceiver, PoolShape, TransferState
from ledger.ledger import Ledger, RequestState, WorkerRole
from ledger.membership import Membership, Timing
from serving.engine_commands import DropRequest, EngineCommand
from serving.rpc import Unavailable

LAYOUT = KvLayout("tiny", torch.float32, 4, PoolShape(num_layers=2, num_kv_heads=2, head_dim=8))


class _Engine:
    """Stands in for LLMEngine: the handle only hands ``drop_request`` to the loop."""

    def drop_request(self, request_id: str) -> None:
        raise AssertionError("runs on the engine thread, not here")


class _EngineLoop:
    """Stands in for the engine thread: records what is submitted to it."""

    def __init__(self) -> None:
        self.calls: list[EngineCommand[Any]] = []

    def submit(self, command: EngineCommand[Any]) -> None:
        assert not command.is_new_work  # a close must not wait for room in the queue
        self.calls.append(command)


@pytest.fixture
def holders(ledger: Ledger) -> Holders:
    """Decode worker "d0", registered in the ledger, with a receiver at its epoch."""
    membership = Membership(
        ledger,
        "d0",
        role=WorkerRole.DECODE,
        address="127.0.0.1:1",
        capacity=8,
        timing=Timing(heartbeat_ms=1000, lease_ms=5000),
    )
    membership.register()
    receiver = KvReceiver(epoch=membership.epoch)
    loop: Any = _EngineLoop()
    transitions = DecodeTransitions(membership)
    return Holders(_Engine(), loop, receiver, LAYOUT, membership, transitions)  # type: ignore[arg-type]


def _decoding(holders: Holders, request_id: str = "r1", pools: Any = None) -> RequestHandle:
    """A request router-0 handed to d0 (DECODING, owned by d0), reserved here: blocks 1-3
    claimed, KV expected in 2-3 (1 cached) of ``pools`` (default: fresh CPU pools), its
    Decode stream running."""
    ledger, epoch = holders.membership.ledger, holders.membership.epoch
    ledger.create_request(request_id, owner="router-0", epoch=1)
    states = [RequestState.QUEUED, RequestState.PREFILLING, RequestState.TRANSFERRING]
    for expected, to in itertools.pairwise([*states, RequestState.DECODING]):
        ledger.transition(
            request_id,
            to,
            expected=expected,
            epoch=1 if expected is RequestState.QUEUED else epoch,
            new_owner="d0",
            new_epoch=epoch,
        )
    handle = RequestHandle(holders, request_id, _builder(request_id), 5, None, 0, "router-0", 1)
    if pools is None:
        params = KVCacheParams(2, 2, 8, 4, torch.float32)
        pools = {KvPool.TARGET: PagedKVCache(params, 8, torch.device("cpu"))}
    handle.hold([1, 2, 3], 1, 3, pools)
    handle.slot = DeltaSlot()
    return handle


def _builder(request_id: str) -> OutputBuilder:
    """The output of a 5-token prompt, without a tokenizer."""
    return OutputBuilder(request_id, RequestStart([1, 2, 3, 4, 5], SamplingParams(), []), None)


def _script_calls(ledger: Ledger) -> int:
    return int(ledger.client.info("commandstats")["cmdstat_evalsha"]["calls"])


# reason -> (engine drops, the record's state and owner after, what the stream raises).
# A finished request is dropped too: a stop string ends it while the engine runs it.
EXPECTED: dict[CloseReason, tuple[int, RequestState, str, type[BaseException] | None]] = {
    CloseReason.FINISHED: (1, RequestState.FINISHED, "d0", None),
    CloseReason.PREEMPTED: (1, RequestState.QUEUED, "router-0", None),
    CloseReason.CANCELLED: (1, RequestState.DECODING, "d0", None),
    CloseReason.ABORTED: (1, RequestState.DECODING, "d0", Aborted),
    CloseReason.LEASE_LOST: (1, RequestState.DECODING, "d0", Unavailable),
    CloseReason.LAPSED: (1, RequestState.DECODING, "d0", None),
    CloseReason.FAILED: (1, RequestState.DECODING, "d0", RuntimeError),
}


@pytest.mark.parametrize("reason", list(CloseReason))
def test_close_releases_everything_once(holders: Holders, reason: CloseReason) -> None:
    ledger, loop = holders.membership.ledger, holders.engine_loop
    handle = _decoding(holders)
    assert holders.handles == {"r1": handle}
    assert holders.receiver.state("r1") is TransferState.RESERVED
    assert holders.membership.is_holding("r1") and len(ledger.holdings()) == 1

    handle.close(reason, "why")
    num_aborts, state, owner, raised = EXPECTED[reason]
    assert handle.closed_by is reason and holders.handles == {}
    assert loop.calls == [DropRequest("r1")] * num_aborts  # type: ignore[attr-defined]
    assert holders.receiver.state("r1") is None
    assert not holders.membership.is_holding("r1") and ledger.holdings() == []
    record = ledger.get_request("r1")
    assert record is not None and (record.state, record.owner) == (state, owner)
    assert handle.slot is not None
    assert type(handle.slot.error) is raised if raised else handle.slot.error is None
    if reason is CloseReason.ABORTED:
        assert str(handle.slot.error) == "why"

    calls = _script_calls(ledger)
    for again in CloseReason:  # closing again, for any reason, does nothing
        handle.close(again)
    assert handle.closed_by is reason and _script_calls(ledger) == calls
    assert len(loop.calls) == num_aborts  # type: ignore[attr-defined]
    record = ledger.get_request("r1")
    assert record is not None and (record.state, record.owner) == (state, owner)


def test_closing_a_replaced_handle_leaves_the_new_one(holders: Holders) -> None:
    """The table forgets a handle only while its entry is that handle."""
    old = _decoding(holders)
    new = RequestHandle(holders, "r1", _builder("r1"), 5, None, 0, "router-0", 1)
    old.close(CloseReason.CANCELLED)
    assert holders.handles == {"r1": new}


def test_metric_status_names_three_endings() -> None:
    statuses = {reason: reason.metric_status for reason in CloseReason}
    assert statuses.pop(CloseReason.FINISHED) == "finished"
    assert statuses.pop(CloseReason.PREEMPTED) == "preempted"
    assert set(statuses.values()) == {"aborted"}

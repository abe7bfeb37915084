"""One request on a decode worker: a ``RequestHandle`` holds its state here and references
everything else it holds (its sequence in the engine, its reservation in the KV receiver,
its block claims and record in the ledger); ``close(reason)`` drops all of it, once,
whichever way the request ends. Blocks that a same-host prefill worker may still be writing
in place stay the request's (quarantined: held in the engine and the ledger) until the KV
receiver says that it stopped; only then do they go back to the allocator.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from decode_worker.transitions import DecodeTransitions
from engine.llm_engine import LLMEngine
from engine.output_processor import OutputBuilder
from engine.outputs import RequestDelta, RequestOutput
from kv_transfer import KvLayout, KvReceiver, KvReservation
from ledger.membership import HeldRequest, Membership
from serving.engine_commands import DropRequest
from serving.engine_loop import EngineLoop
from serving.rpc import Overloaded, Unavailable

log = logging.getLogger(__name__)


class Aborted(Exception):
    """Ends a stream with an ABORT chunk (the Abort RPC) rather than an error status."""


class CloseReason(enum.Enum):
    """How a request ended here; each says what ``RequestHandle.close`` does besides
    freeing the request's blocks in the engine, the receiver and the ledger."""

    FINISHED = "finished"  # last token sampled (the engine freed it): record FINISHED
    PREEMPTED = "preempted"  # the engine handed it back: record QUEUED, owned by its router
    CANCELLED = "cancelled"  # the router ended the Decode stream (client gone, migrating)
    ABORTED = "aborted"  # the Abort RPC (router cancelling or migrating it): ABORT chunk
    LEASE_LOST = "lease_lost"  # the ledger lost it (a stall, Redis lost data): UNAVAILABLE
    LAPSED = "lapsed"  # reserved, but its Decode never came
    FAILED = "failed"  # reserving, receiving or the engine failed: the stream errs

    @property
    def metric_status(self) -> str:
        """The ``status`` label of the requests counter (finished, preempted, aborted)."""
        is_own = self in (CloseReason.FINISHED, CloseReason.PREEMPTED)
        return self.value if is_own else "aborted"


class DeltaSlot:
    """The deltas of one request that its stream has not read yet, in order. The reader
    assembles them (``OutputBuilder``) in its own turn of the event loop, all it finds
    at once: a slow reader makes one output of many steps."""

    def __init__(self) -> None:
        self.deltas: list[RequestDelta] = []
        self.error: BaseException | None = None
        self._event = asyncio.Event()

    def put(self, delta: RequestDelta) -> None:
        self.deltas.append(delta)
        self._event.set()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self._event.set()

    async def take(self) -> list[RequestDelta]:
        """Waits for deltas; all of them, oldest first."""
        await self._event.wait()
        self._event.clear()
        if self.error is not None:
            raise self.error
        deltas, self.deltas = self.deltas, []
        return deltas


@dataclass(frozen=True)
class Holders:
    """Where a decode worker's requests are held besides their handles (one per worker)."""

    engine: LLMEngine  # sequences; touched on the engine thread only
    engine_loop: EngineLoop[Any]
    receiver: KvReceiver  # reservations the prefill workers push KV into
    layout: KvLayout
    membership: Membership  # block claims and leases; its ledger holds the records
    transitions: DecodeTransitions  # the records' moves
    handles: dict[str, RequestHandle] = field(default_factory=dict)  # the live requests
    # Closed requests whose blocks wait for a same-host push into them to stop.
    quarantined: dict[str, RequestHandle] = field(default_factory=dict)

    def check_new(self, request_id: str) -> None:
        """Raises unless ``request_id`` may be reserved here now: ValueError while it is
        live, Overloaded (retry later or elsewhere) while its last blocks are quarantined."""
        if request_id in self.handles:
            raise ValueError(f"request_id: {request_id!r} is already reserved here")
        if request_id in self.quarantined:
            raise Overloaded(
                f"request_id: {request_id!r}: a push into its earlier blocks here is still "
                "stopping; retry later or on another worker"
            )


@dataclass(eq=False)
class RequestHandle:
    """A request reserved or decoding on this worker, from Reserve to its ``close``."""

    holders: Holders = field(repr=False)
    request_id: str
    outputs: OutputBuilder  # its output, assembled from its deltas
    num_prompt_tokens: int  # the client's prompt (without output resumed from a preemption)
    logprobs: int | None
    num_output_tokens_sent: int  # output tokens an earlier attempt already streamed (a preemption)
    router_id: str  # who gets the request back on a preemption
    router_epoch: int
    lora: str = ""  # the LoRA adapter it runs under, and its digest ("": the base model)
    lora_digest: str = ""
    block_ids: list[int] = field(default_factory=list)  # as reserved, then as grown
    num_output_chars_sent: int = 0  # characters of the resumed output already streamed
    reserved_at: float = field(default_factory=time.monotonic)
    push_failed_at: float | None = None  # when its KV push was seen refused or aborted
    slot: DeltaSlot | None = None  # set once Decode started
    closed_by: CloseReason | None = None
    _kv_stopping: asyncio.Future[None] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.holders.handles[self.request_id] = self

    def hold(
        self, table: list[int], num_cached_blocks: int, num_kv_blocks: int, pools: Any
    ) -> None:
        """The engine reserved ``table``: the receiver expects KV in its uncached blocks up
        to ``num_kv_blocks`` (the prompt's; the rest are lookahead slots), the ledger
        records all of them as this worker's (both pools share the ids)."""
        h = self.holders
        self.block_ids = table
        kv_blocks = table[num_cached_blocks:num_kv_blocks]
        reservation = KvReservation(
            self.request_id, kv_blocks, pools, h.layout, self.lora, self.lora_digest
        )
        h.receiver.reserve(reservation)
        h.membership.claim(self.request_id, table, has_draft=h.layout.draft is not None)

    async def wait_for_kv(self, timeout_s: float | None) -> None:
        """Waits until the pushed KV is in the blocks (``None``: nothing is pushed, but a
        push that was opened must have stopped writing them), then lets the receiver
        forget the reservation."""
        if timeout_s is not None:
            await self.holders.receiver.wait_done(self.request_id, timeout_s)
        stopping = self._drop_reservation()
        if stopping is not None:
            await asyncio.shield(stopping)

    async def next_output(self) -> RequestOutput:
        """The request's output once more deltas arrived (all that did, assembled)."""
        assert self.slot is not None
        while True:
            taken = [self.outputs.take(delta) for delta in await self.slot.take()]
            if any(taken):
                return self.outputs.output()

    def resize(self, table: list[int]) -> None:
        """The engine grew (or shrank) the request's table: the ledger follows, later."""
        self.block_ids = table
        self.holders.membership.resize(self.request_id, table)

    def held(self, table: list[int] | None, fields: Mapping[str, str | int]) -> HeldRequest:
        """How the ledger should record this request again after it lost data."""
        return HeldRequest(self.request_id, self.block_ids if table is None else table, fields)

    def close(self, reason: CloseReason, detail: str = "") -> None:
        """Ends the request here: fails its stream where ``reason`` says so, frees its
        blocks in the engine, the receiver and the ledger, and records how it ended.
        Only the first call acts. A Redis error handing back a preempted request is
        raised (the stream fails; the router resumes the request as a lost stream)."""
        if self.closed_by is not None:
            return
        self.closed_by = reason
        h, rid = self.holders, self.request_id
        if h.handles.get(rid) is self:
            del h.handles[rid]
        error = _stream_error(reason, detail, h.membership.worker_id)
        if self.slot is not None and error is not None:
            self.slot.fail(error)
        stopping = self._drop_reservation()
        if stopping is None:
            self._free(reason)
        else:
            log.info("%s %s: its blocks wait for the push into them to stop", rid, reason.value)
            h.quarantined[rid] = self
            stopping.add_done_callback(lambda _: self._free(reason))
        if reason is CloseReason.FINISHED:
            h.transitions.finish(rid)
        elif reason is CloseReason.PREEMPTED:
            log.info("preempted %s: handed back to %s", rid, self.router_id)
            if self.router_id:
                h.transitions.hand_back(rid, self.router_id, self.router_epoch)

    def _drop_reservation(self) -> asyncio.Future[None] | None:
        """Lets the receiver forget the reservation; a future (kept for ``close``) while a
        same-host push may still be writing the blocks."""
        stopping = self.holders.receiver.drop(self.request_id)
        if stopping is not None:
            self._kv_stopping = stopping
        if self._kv_stopping is None or self._kv_stopping.done():
            return None
        return self._kv_stopping

    def _free(self, reason: CloseReason) -> None:
        """Gives the request's blocks back to the allocator and forgets them in the ledger,
        together, so that the ledger's holdings follow the allocator."""
        h, rid = self.holders, self.request_id
        if h.quarantined.get(rid) is self:
            del h.quarantined[rid]
        # Also when finished: a stop string ends a request that the engine still runs.
        stopped_after = len(self.outputs.token_ids) if self.outputs.is_ended_here else None
        h.engine_loop.submit(DropRequest(rid, stopped_after=stopped_after))
        h.membership.free(rid)


def _stream_error(reason: CloseReason, detail: str, worker_id: str) -> BaseException | None:
    """What a running Decode stream raises when the request is closed under it, if any."""
    if reason is CloseReason.ABORTED:
        return Aborted(detail)
    if reason is CloseReason.LEASE_LOST:
        return Unavailable(
            f"decode worker {worker_id}: lost its lease on the request's KV blocks in the "
            "ledger (a stall, or Redis restarted)"
        )
    if reason is CloseReason.FAILED:
        return RuntimeError(detail)
    return None

"""Every ledger transition the router makes for a request, in one place.

The router creates a request's record (QUEUED, its own), hands it to the prefill worker
(PREFILLING), takes it back from whichever worker holds it when an attempt fails (QUEUED
again, for the next attempt), and ends it (CANCELLED or FAILED) however it ended. A
worker may be moving the same record meanwhile, so the last two read the record and move
it from the state it is in, at its holder's epoch, reading again on a conflict
(``_move_from_current``). The workers' own transitions are in ``prefill_worker/
transitions.py`` and ``decode_worker/transitions.py``; ``tests/services/
test_ledger_writes.py`` keeps every transition inside these three files."""

from __future__ import annotations

import logging
from collections.abc import Callable

import redis

from ledger.ledger import LedgerConflict, Reclaimed, RequestRecord, RequestState
from ledger.membership import Membership
from router.route import Route

log = logging.getLogger(__name__)

MOVE_ATTEMPTS = 5  # reads of a record that its holder keeps moving, before giving up
HELD_BY_WORKERS = (RequestState.PREFILLING, RequestState.TRANSFERRING, RequestState.DECODING)


class RouterTransitions:
    """The router's transitions of its requests' records (see the module's docstring)."""

    def __init__(self, membership: Membership, model_name: str) -> None:
        self.membership = membership
        self.ledger = membership.ledger
        self.model_name = model_name

    def record(self, route: Route) -> None:
        """A new request: QUEUED, owned by this router at its current epoch."""
        valid = route.request
        route.owner_epoch = self.membership.epoch
        self.ledger.create_request(
            valid.request_id,
            owner=self.membership.worker_id,
            epoch=route.owner_epoch,
            fields={
                "model": self.model_name,
                "num_prompt_tokens": len(valid.prompt_token_ids),
                "prefill_worker": route.prefill.worker_id,
                "decode_worker": route.decode.worker_id,
            },
        )

    def hand_to_prefill(self, route: Route) -> None:
        """QUEUED -> PREFILLING: the prefill worker owns it from here (its decode worker
        holds the reserved blocks)."""
        self.ledger.transition(
            route.request.request_id,
            RequestState.PREFILLING,
            expected=RequestState.QUEUED,
            epoch=route.owner_epoch,
            new_owner=route.prefill.worker_id,
            new_epoch=route.prefill.epoch,
        )

    def take_back(self, route: Route, error: BaseException) -> None:
        """The request, wherever its prefill or decode worker left it, becomes QUEUED and
        this router's again, for the next attempt (prompt + tokens sent). Their epochs are
        superseded, so a worker still alive can no longer move it. A request the ledger
        forgot (its Redis restarted empty, and no decode worker recorded it again) is
        recorded anew; one that ended meanwhile is not resumed: ``error`` is raised."""
        me = self.membership.worker_id
        try:
            record = self._move_from_current(
                route.request.request_id,
                RequestState.QUEUED,
                is_settled=lambda r: r.state not in HELD_BY_WORKERS,
                new_owner=me,
                new_epoch=self.membership.epoch,
            )
        except LedgerConflict:
            raise error from None
        if record is None:
            log.warning(
                "%s: not in the ledger any more (Redis restarted?); recorded again",
                route.request.request_id,
            )
            self.record(route)
        elif record.state is RequestState.QUEUED and record.owner == me:
            route.owner_epoch = record.epoch
        else:
            raise error  # ended, or someone else's: nothing to resume

    def end(self, rid: str, state: RequestState, error: str, *, retryable: bool) -> None:
        """Moves the request to ``state`` (CANCELLED or FAILED) from wherever it is;
        ``retryable``: its client was told to retry, so the id may be used again."""
        try:
            self._move_from_current(
                rid,
                state,
                is_settled=lambda r: r.state.is_terminal,
                error=error[:500],
                retryable=retryable,
            )
        except LedgerConflict:
            log.warning("%s: could not record %s in the ledger", rid, state)

    def is_forgotten(self, rid: str) -> bool:
        """Whether the ledger has no record of this (recorded) request: its Redis restarted
        empty. False when Redis cannot be asked (that error speaks for itself)."""
        try:
            return self.ledger.get_request(rid) is None
        except redis.RedisError:
            return False

    def reclaim_expired(self) -> list[Reclaimed]:
        """Releases in the ledger the blocks of holdings whose lease expired (their
        workers stopped renewing them: dead, or stalled past the lease)."""
        return self.ledger.reap_expired()

    def _move_from_current(
        self,
        rid: str,
        to: RequestState,
        *,
        is_settled: Callable[[RequestRecord], bool],
        new_owner: str | None = None,
        new_epoch: int | None = None,
        error: str | None = None,
        retryable: bool = False,
    ) -> RequestRecord | None:
        """Moves the request to ``to`` from the state it is in, at its holder's epoch,
        unless its record is gone (None) or ``is_settled`` (that record). Its holder may
        move it meanwhile: then it is read again, up to MOVE_ATTEMPTS times, after which
        LedgerConflict. Returns the record as it ends up."""
        for _ in range(MOVE_ATTEMPTS):
            record = self.ledger.get_request(rid)
            if record is None or is_settled(record):
                return record
            try:
                return self.ledger.transition(
                    rid,
                    to,
                    expected=record.state,
                    epoch=record.epoch,
                    new_owner=new_owner,
                    new_epoch=new_epoch,
                    error=error,
                    retryable=retryable,
                )
            except LedgerConflict:
                continue
        raise LedgerConflict(f"request {rid}: moved by its holder {MOVE_ATTEMPTS} times")

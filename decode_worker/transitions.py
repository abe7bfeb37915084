"""Every ledger transition a decode worker makes for a request, in one place.

A prefill worker hands a request to this worker in DECODING. The decode worker ends it
FINISHED, or, preempted for lack of KV blocks, hands it back QUEUED to the router that
sent it, which resumes it elsewhere. A conflict means that the router moved it meanwhile
(cancelled it, or took it back after losing the stream): the router decided, and the
worker goes along. A co-located worker's prefill side moves its requests as any prefill
worker does (prefill_worker/transitions.py)."""

from __future__ import annotations

import contextlib
import logging

import redis

from ledger.ledger import LedgerConflict, RequestState
from ledger.membership import Membership

log = logging.getLogger(__name__)


class DecodeTransitions:
    """A decode worker's transitions of the records of the requests it owns."""

    def __init__(self, membership: Membership) -> None:
        self.membership = membership

    def finish(self, rid: str) -> None:
        """DECODING -> FINISHED. Not raised: a conflict (the router cancelled it meanwhile)
        or an unreachable Redis (the client still gets its last chunk; the record, if it
        survives, expires)."""
        try:
            self._move(rid, RequestState.DECODING, RequestState.FINISHED)
        except LedgerConflict:
            pass
        except redis.RedisError as e:
            log.warning("%s finished, not recorded in the ledger: redis: %s", rid, e)

    def hand_back(self, rid: str, router_id: str, router_epoch: int) -> None:
        """DECODING -> QUEUED, owned by the router that sent it again, which resumes it. A
        conflict (the router decided meanwhile) is not raised; a Redis error is."""
        with contextlib.suppress(LedgerConflict):
            self._move(
                rid,
                RequestState.DECODING,
                RequestState.QUEUED,
                new_owner=router_id,
                new_epoch=router_epoch,
            )

    def _move(
        self,
        rid: str,
        expected: RequestState,
        to: RequestState,
        *,
        new_owner: str | None = None,
        new_epoch: int | None = None,
    ) -> None:
        self.membership.ledger.transition(
            rid,
            to,
            expected=expected,
            epoch=self.membership.epoch,
            new_owner=new_owner,
            new_epoch=new_epoch,
        )

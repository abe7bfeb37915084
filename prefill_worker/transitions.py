"""Every ledger transition a prefill worker makes for a request, in one place.

The router hands a request to this worker in PREFILLING. Once its prompt is computed
the worker moves it to TRANSFERRING, and once its KV is pushed it hands it to the decode
worker that holds the blocks (DECODING). A conflict means that the router moved it
meanwhile (cancelled, or took it back): the caller drops the request."""

from __future__ import annotations

import logging

from ledger.ledger import LedgerConflict, RequestState
from ledger.membership import Membership

log = logging.getLogger(__name__)


class PrefillTransitions:
    """A prefill worker's transitions of the records of the requests it owns."""

    def __init__(self, membership: Membership) -> None:
        self.membership = membership

    def start_transfer(self, rid: str) -> None:
        """PREFILLING -> TRANSFERRING: computed, its KV on its way to the decode worker."""
        self._move(rid, RequestState.PREFILLING, RequestState.TRANSFERRING)

    def hand_to_decode(self, rid: str, decode_worker_id: str, decode_epoch: int) -> None:
        """TRANSFERRING -> DECODING, owned by the decode worker from here."""
        self._move(
            rid,
            RequestState.TRANSFERRING,
            RequestState.DECODING,
            new_owner=decode_worker_id,
            new_epoch=decode_epoch,
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
        try:
            self.membership.ledger.transition(
                rid,
                to,
                expected=expected,
                epoch=self.membership.epoch,
                new_owner=new_owner,
                new_epoch=new_epoch,
            )
        except LedgerConflict:
            log.info("%s: ledger refused %s -> %s (cancelled meanwhile?)", rid, expected, to)
            raise

"""What the ledger tests share: three registered workers and requests driven along a
legal path of states."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from ledger.ledger import Ledger, RequestRecord, RequestState, WorkerRole

S = RequestState
LEASE_MS = 60_000


@dataclass(frozen=True)
class Epochs:
    router: int
    prefill: int
    decode: int


def record_of(ledger: Ledger, request_id: str) -> RequestRecord:
    record = ledger.get_request(request_id)
    assert record is not None, f"no record of {request_id}"
    return record


def register(ledger: Ledger, ttl_ms: int = 60_000) -> Epochs:
    return Epochs(
        router=ledger.register_worker(
            "router-0", role=WorkerRole.ROUTER, address="127.0.0.1:1", capacity=0, ttl_ms=ttl_ms
        ),
        prefill=ledger.register_worker(
            "prefill-0", role=WorkerRole.PREFILL, address="127.0.0.1:2", capacity=64, ttl_ms=ttl_ms
        ),
        decode=ledger.register_worker(
            "decode-0", role=WorkerRole.DECODE, address="127.0.0.1:3", capacity=128, ttl_ms=ttl_ms
        ),
    )


def drive(ledger: Ledger, request_id: str, state: RequestState, e: Epochs) -> None:
    """Creates a request and takes it to ``state`` along a legal path."""
    ledger.create_request(request_id, owner="router-0", epoch=e.router)
    if state in (S.FAILED, S.CANCELLED):
        ledger.transition(request_id, state, expected=S.QUEUED, epoch=e.router)
        return
    path = [S.QUEUED, S.PREFILLING, S.TRANSFERRING, S.DECODING, S.FINISHED]
    for prev, to in itertools.pairwise(path[: path.index(state) + 1]):
        step(ledger, request_id, prev, to, e)


def step(ledger: Ledger, rid: str, prev: RequestState, to: RequestState, e: Epochs) -> None:
    if prev is S.QUEUED:  # the router hands the request to the prefill worker
        ledger.transition(
            rid, to, expected=prev, epoch=e.router, new_owner="prefill-0", new_epoch=e.prefill
        )
    elif prev is S.TRANSFERRING:  # the prefill worker hands it to the decode worker
        ledger.transition(
            rid, to, expected=prev, epoch=e.prefill, new_owner="decode-0", new_epoch=e.decode
        )
    else:
        owner = e.prefill if prev is S.PREFILLING else e.decode
        ledger.transition(rid, to, expected=prev, epoch=owner)

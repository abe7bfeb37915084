"""Ledger audit: every kind of discrepancy, from a real ledger and from plain holdings."""

from __future__ import annotations

from ledger.audit import (
    AllocatorReport,
    Discrepancy,
    DiscrepancyKind,
    find_discrepancies,
    seen_in_every_look,
)
from ledger.ledger import Holding, KvPool, Ledger, RequestState, WorkerRole

K = DiscrepancyKind


def _holding(request_id: str, worker_id: str, ids: set[int], state: RequestState | None) -> Holding:
    blocks = {KvPool.TARGET: frozenset(ids), KvPool.DRAFT: frozenset()}
    return Holding(request_id, worker_id, 1, blocks, 1000, state)


def test_consistent_ledger_has_no_discrepancy() -> None:
    holdings = [_holding("r1", "d0", {1, 2}, RequestState.DECODING)]
    reports = {"d0": AllocatorReport(owned=frozenset({1, 2}), cached=frozenset({9}))}
    assert find_discrepancies(holdings, reports, {"d0"}) == []
    assert find_discrepancies(holdings, {"d0": {1, 2}}, set()) == []  # a bare set: owned ids


def test_each_kind_of_discrepancy() -> None:
    holdings = [
        _holding("r1", "d0", {1, 2, 3}, RequestState.DECODING),
        _holding("r2", "d0", {3, 4}, RequestState.TRANSFERRING),
        _holding("r3", "d0", {5}, RequestState.FINISHED),
        _holding("r4", "gone", {1}, None),
    ]
    reports = {"d0": AllocatorReport(owned=frozenset({1, 3, 5, 8}), cached=frozenset({4}))}
    found = find_discrepancies(holdings, reports, registered_workers={"d0"})
    by_kind = {d.kind: d for d in found}
    assert sorted(by_kind) == sorted(K)
    assert by_kind[K.LEDGER_ONLY] == Discrepancy(
        K.LEDGER_ONLY, "d0", (2,), ("r1",), "ledger: held by r1; worker: not owned"
    )
    assert (by_kind[K.CACHED_BUT_HELD].block_ids, by_kind[K.CACHED_BUT_HELD].request_ids) == (
        (4,),
        ("r2",),
    )
    assert by_kind[K.WORKER_ONLY].block_ids == (8,)
    assert (by_kind[K.DOUBLE_HELD].block_ids, by_kind[K.DOUBLE_HELD].request_ids) == (
        (3,),
        ("r1", "r2"),
    )
    ended = [d for d in found if d.kind is K.ENDED_REQUEST]
    assert [(d.request_ids, d.detail) for d in ended] == [
        (("r3",), "request r3 is FINISHED; its blocks are still held"),
        (("r4",), "request r4 is expired; its blocks are still held"),
    ]
    assert by_kind[K.DEAD_WORKER].worker_id == "gone"


def test_requests_sharing_a_cached_prefix_are_double_held_only_past_the_workers_count() -> None:
    """Two requests hold prefix blocks 1 and 2 that their worker counts twice (a shared
    cached prefix): not double held. Block 2 held by a third request is, and so is a block
    the worker counts once; a worker that reports no counts (an older one) counts 1."""
    holdings = [
        _holding("r1", "d0", {1, 2, 5}, RequestState.DECODING),
        _holding("r2", "d0", {1, 2, 6}, RequestState.DECODING),
        _holding("r3", "d0", {2, 6}, RequestState.DECODING),
        _holding("r4", "d1", {9}, RequestState.DECODING),
        _holding("r5", "d1", {9}, RequestState.DECODING),
    ]
    reports = {
        "d0": AllocatorReport(owned=frozenset({1, 2, 5, 6}), ref_counts={1: 2, 2: 2, 6: 1}),
        "d1": AllocatorReport(owned=frozenset({9})),
    }
    found = find_discrepancies(holdings, reports, registered_workers={"d0", "d1"})
    assert [(d.kind, d.worker_id, d.block_ids, d.request_ids, d.detail) for d in found] == [
        (K.DOUBLE_HELD, "d0", (2,), ("r1", "r2", "r3"), "block 2 held by 3 requests; "
         "its worker counts 2"),
        (K.DOUBLE_HELD, "d0", (6,), ("r2", "r3"), "block 6 held by 2 requests; "
         "its worker counts 1"),
        (K.DOUBLE_HELD, "d1", (9,), ("r4", "r5"), "block 9 held by 2 requests; "
         "its worker counts 1"),
    ]  # fmt: skip


def test_audit_through_the_ledger(ledger: Ledger) -> None:
    epoch = ledger.register_worker(
        "d0", role=WorkerRole.DECODE, address="127.0.0.1:9", capacity=16, ttl_ms=60_000
    )
    ledger.create_request("r1", owner="router-0", epoch=7)
    ledger.claim_blocks(
        "r1", "d0", epoch=epoch, pool=KvPool.TARGET, block_ids=[0, 1], lease_ms=60_000
    )
    ledger.claim_blocks(
        "r1", "d0", epoch=epoch, pool=KvPool.DRAFT, block_ids=[0, 1], lease_ms=60_000
    )
    assert ledger.audit({"d0": {0, 1}}) == []
    [leak] = ledger.audit({"d0": {0}})
    assert (leak.kind, leak.block_ids, leak.request_ids) == (K.LEDGER_ONLY, (1,), ("r1",))
    ledger.transition("r1", RequestState.CANCELLED, expected=RequestState.QUEUED, epoch=7)
    assert [d.kind for d in ledger.audit({"d0": {0, 1}})] == [K.ENDED_REQUEST]


def test_only_what_every_look_found_counts() -> None:
    """A block granted between reading the allocator and the ledger shows in one look; a
    leak, in all of them."""
    holdings = [_holding("r1", "d0", {1, 2, 3}, RequestState.DECODING)]
    growing = find_discrepancies(holdings, {"d0": {1, 2}}, {"d0"})  # 3: granted meanwhile
    leaking = find_discrepancies(holdings, {"d0": {1, 2, 3, 7}}, {"d0"})  # 7: a leak
    grown = [_holding("r1", "d0", {1, 2, 3, 4}, RequestState.DECODING)]
    both = find_discrepancies(grown, {"d0": {1, 2, 3, 7}}, {"d0"})  # 4 granted, 7 leaked
    assert [(d.kind, d.block_ids) for d in both] == [(K.LEDGER_ONLY, (4,)), (K.WORKER_ONLY, (7,))]
    assert seen_in_every_look([growing, leaking]) == []
    assert seen_in_every_look([growing]) == growing
    assert seen_in_every_look([leaking, both]) == [both[1]]
    ended = [_holding("r9", "d0", set(), None)]  # no blocks: compared by its request
    gone = find_discrepancies(ended, {}, {"d0"})
    assert seen_in_every_look([gone, gone]) == gone
    assert seen_in_every_look([gone, []]) == []
    assert seen_in_every_look([]) == []

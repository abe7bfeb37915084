"""The Redis ledger against a real redis-server: states, fencing, block claims, leases."""

from __future__ import annotations

import time
from collections.abc import Sequence

import pytest

from ledger.ledger import (
    ALLOWED_TRANSITIONS,
    KvPool,
    Ledger,
    LedgerConflict,
    WorkerRole,
)
from tests.ledger.ledger_helpers import LEASE_MS, S, drive, record_of, register, step


def test_happy_path_through_every_state(ledger: Ledger) -> None:
    e = register(ledger)
    created = ledger.create_request(
        "r1", owner="router-0", epoch=e.router, fields={"model": "smollm2", "num_prompt_tokens": 7}
    )
    assert (created.state, created.owner, created.epoch, created.version) == (
        S.QUEUED,
        "router-0",
        e.router,
        0,
    )
    assert created.fields == {"model": "smollm2", "num_prompt_tokens": "7"}
    with pytest.raises(LedgerConflict, match="expected no record"):
        ledger.create_request("r1", owner="router-0", epoch=e.router)

    rec = ledger.transition(
        "r1",
        S.PREFILLING,
        expected=S.QUEUED,
        epoch=e.router,
        new_owner="prefill-0",
        new_epoch=e.prefill,
    )
    assert (rec.state, rec.owner, rec.epoch) == (S.PREFILLING, "prefill-0", e.prefill)
    rec = ledger.transition("r1", S.TRANSFERRING, expected=S.PREFILLING, epoch=e.prefill)
    rec = ledger.transition(
        "r1",
        S.DECODING,
        expected=S.TRANSFERRING,
        epoch=e.prefill,
        new_owner="decode-0",
        new_epoch=e.decode,
    )
    assert (rec.state, rec.owner) == (S.DECODING, "decode-0")
    # Preemption hand-back to the router, then a second round.
    ledger.transition(
        "r1",
        S.QUEUED,
        expected=S.DECODING,
        epoch=e.decode,
        new_owner="router-0",
        new_epoch=e.router,
    )
    for prev, to in [
        (S.QUEUED, S.PREFILLING),
        (S.PREFILLING, S.TRANSFERRING),
        (S.TRANSFERRING, S.DECODING),
    ]:
        step(ledger, "r1", prev, to, e)
    rec = ledger.transition("r1", S.FINISHED, expected=S.DECODING, epoch=e.decode)
    assert rec.state is S.FINISHED and rec.version == 8
    assert rec.created_ms <= rec.updated_ms
    assert ledger.get_request("r1") == rec
    assert ledger.get_request("nope") is None
    # Ended records keep a short TTL; live ones the long one.
    assert 0 < ledger.client.pttl(ledger.keys.record("r1")) <= 5000
    live = ledger.create_request("r2", owner="router-0", epoch=e.router)
    assert ledger.client.pttl(ledger.keys.record(live.request_id)) > 5000


def test_an_id_is_used_again_only_after_a_retryable_failure(ledger: Ledger) -> None:
    """A client told to retry (UNAVAILABLE) resends its request under the same id: the new
    record replaces the failed one. Any other record of the id refuses it."""
    e = register(ledger)
    for rid, to, retryable in [
        ("retried", S.FAILED, True),
        ("failed", S.FAILED, False),
        ("cancelled", S.CANCELLED, False),
        ("live", None, False),
    ]:
        ledger.create_request(rid, owner="router-0", epoch=e.router, fields={"model": "a"})
        if to is not None:
            ended = ledger.transition(
                rid, to, expected=S.QUEUED, epoch=e.router, error="x", retryable=retryable
            )
            assert ended.retryable is retryable and "retryable" not in ended.fields
    again = ledger.create_request("retried", owner="router-1", epoch=e.router, fields={"n": 1})
    assert (again.state, again.owner, again.version, again.error) == (S.QUEUED, "router-1", 0, "")
    assert (again.retryable, again.fields) == (False, {"n": "1"})  # nothing of the old one
    for rid, found in [("failed", "FAILED"), ("cancelled", "CANCELLED"), ("live", "QUEUED")]:
        with pytest.raises(LedgerConflict, match=f"found one in {found} \\(duplicate id\\)"):
            ledger.create_request(rid, owner="router-0", epoch=e.router)
    with pytest.raises(ValueError, match="retryable: only a request that FAILED"):
        ledger.transition("live", S.CANCELLED, expected=S.QUEUED, epoch=e.router, retryable=True)


def test_every_illegal_transition_is_refused(ledger: Ledger) -> None:
    e = register(ledger)
    for state in S:
        rid = f"in-{state.lower()}"
        drive(ledger, rid, state, e)
        epoch = record_of(ledger, rid).epoch
        for to in S:
            if to not in ALLOWED_TRANSITIONS[state]:
                with pytest.raises(LedgerConflict, match=f"illegal transition {state} -> {to}"):
                    ledger.transition(rid, to, expected=state, epoch=epoch)
        # Legal edges from other states are refused by the script: wrong actual state.
        for expected, targets in ALLOWED_TRANSITIONS.items():
            if expected is state:
                continue
            for to in targets:
                with pytest.raises(
                    LedgerConflict, match=f"expected state {expected}, found {state}"
                ):
                    ledger.transition(rid, to, expected=expected, epoch=epoch)
        assert record_of(ledger, rid).state is state
    with pytest.raises(LedgerConflict, match="found no record"):
        ledger.transition("missing", S.PREFILLING, expected=S.QUEUED, epoch=e.router)


def test_stale_epoch_is_refused(ledger: Ledger) -> None:
    e = register(ledger)
    drive(ledger, "r1", S.PREFILLING, e)
    # The router handed the request over: its epoch no longer moves it.
    with pytest.raises(
        LedgerConflict, match=f"expected owner prefill-0 at epoch {e.prefill}, got epoch {e.router}"
    ):
        ledger.transition("r1", S.TRANSFERRING, expected=S.PREFILLING, epoch=e.router)
    # The prefill worker restarts (new registration, new epoch): neither instance can
    # move the request the old one owned; the router must re-route it.
    new_prefill = ledger.register_worker(
        "prefill-0", role=WorkerRole.PREFILL, address="127.0.0.1:2", capacity=64, ttl_ms=60_000
    )
    assert new_prefill > e.prefill > e.router
    with pytest.raises(LedgerConflict, match="stale epoch"):
        ledger.transition("r1", S.TRANSFERRING, expected=S.PREFILLING, epoch=new_prefill)
    with pytest.raises(
        LedgerConflict, match=f"stale epoch: expected {new_prefill}, got {e.prefill}"
    ):
        ledger.heartbeat("prefill-0", epoch=e.prefill, ttl_ms=60_000, load=0.5)
    with pytest.raises(LedgerConflict, match="stale epoch"):
        ledger.deregister_worker("prefill-0", epoch=e.prefill)
    # Block claims: a newer instance supersedes an older one, never the reverse.
    ledger.claim_blocks(
        "r1", "decode-0", epoch=e.decode, pool=KvPool.TARGET, block_ids=[1, 2], lease_ms=LEASE_MS
    )
    new_decode = ledger.register_worker(
        "decode-0", role=WorkerRole.DECODE, address="127.0.0.1:3", capacity=128, ttl_ms=60_000
    )
    assert (
        ledger.claim_blocks(
            "r1", "decode-0", epoch=new_decode, pool=KvPool.TARGET, block_ids=[7], lease_ms=LEASE_MS
        )
        == 1
    )
    for stale_call in (
        lambda: ledger.claim_blocks(
            "r1", "decode-0", epoch=e.decode, pool=KvPool.TARGET, block_ids=[3], lease_ms=LEASE_MS
        ),
        lambda: ledger.renew_lease("r1", "decode-0", epoch=e.decode, lease_ms=LEASE_MS),
        lambda: ledger.free_blocks("r1", "decode-0", epoch=e.decode),
    ):
        with pytest.raises(
            LedgerConflict,
            match=f"stale epoch for worker decode-0: expected {new_decode}, got {e.decode}",
        ):
            stale_call()
    [holding] = ledger.holdings()
    assert (holding.epoch, holding.blocks[KvPool.TARGET]) == (new_decode, frozenset({7}))


def test_claim_release_and_ended_requests(ledger: Ledger) -> None:
    e = register(ledger)
    drive(ledger, "r1", S.QUEUED, e)
    assert (
        ledger.claim_blocks(
            "r1",
            "decode-0",
            epoch=e.decode,
            pool=KvPool.TARGET,
            block_ids=[4, 5, 6],
            lease_ms=LEASE_MS,
        )
        == 3
    )
    assert (
        ledger.claim_blocks(
            "r1",
            "decode-0",
            epoch=e.decode,
            pool=KvPool.TARGET,
            block_ids=[6, 7],
            lease_ms=LEASE_MS,
        )
        == 4
    )
    assert (
        ledger.claim_blocks(
            "r1",
            "decode-0",
            epoch=e.decode,
            pool=KvPool.DRAFT,
            block_ids=range(4, 8),
            lease_ms=LEASE_MS,
        )
        == 4
    )
    many = range(100, 100 + 2500)  # more than one Lua unpack() batch
    assert (
        ledger.claim_blocks(
            "r1",
            "prefill-0",
            epoch=e.prefill,
            pool=KvPool.TARGET,
            block_ids=many,
            lease_ms=LEASE_MS,
        )
        == 2500
    )
    by_worker = {h.worker_id: h for h in ledger.holdings()}
    assert by_worker["decode-0"].blocks == {KvPool.TARGET: {4, 5, 6, 7}, KvPool.DRAFT: {4, 5, 6, 7}}
    assert (
        by_worker["decode-0"].is_request_live and 0 < by_worker["decode-0"].lease_ttl_ms <= LEASE_MS
    )
    assert ledger.holdings("prefill-0")[0].blocks[KvPool.TARGET] == frozenset(many)

    assert (
        ledger.free_blocks("r1", "decode-0", epoch=e.decode, pool=KvPool.TARGET, block_ids=[4, 99])
        == 1
    )
    assert ledger.free_blocks("r1", "decode-0", epoch=e.decode, pool=KvPool.DRAFT) == 4
    assert ledger.free_blocks("r1", "decode-0", epoch=e.decode) == 3
    assert ledger.free_blocks("r1", "decode-0", epoch=e.decode) == 0  # idempotent
    assert (
        ledger.free_blocks("r1", "prefill-0", epoch=e.prefill, pool=KvPool.TARGET, block_ids=many)
        == 2500
    )
    assert ledger.holdings() == []
    with pytest.raises(LedgerConflict, match="found none"):
        ledger.renew_lease("r1", "decode-0", epoch=e.decode, lease_ms=LEASE_MS)

    ledger.transition("r1", S.CANCELLED, expected=S.QUEUED, epoch=e.router)
    with pytest.raises(LedgerConflict, match="expected a live request, found CANCELLED"):
        ledger.claim_blocks(
            "r1", "decode-0", epoch=e.decode, pool=KvPool.TARGET, block_ids=[1], lease_ms=LEASE_MS
        )
    with pytest.raises(LedgerConflict, match="found no record"):
        ledger.claim_blocks(
            "nope", "decode-0", epoch=e.decode, pool=KvPool.TARGET, block_ids=[1], lease_ms=LEASE_MS
        )
    with pytest.raises(ValueError, match="block_ids"):
        ledger.claim_blocks(
            "r1", "decode-0", epoch=e.decode, pool=KvPool.TARGET, block_ids=[-1], lease_ms=LEASE_MS
        )
    with pytest.raises(ValueError, match="request_id"):
        ledger.create_request("a{b}", owner="router-0", epoch=e.router)


def test_resize_follows_the_owners_allocator(ledger: Ledger) -> None:
    """A decode worker's table grows (and shrinks) while it decodes: recorded in both pools
    in one script that checks the state, the owner's epoch, the lease and the count the
    worker last recorded; an empty table ends the holding as a release does."""
    e = register(ledger)
    for rid, block_ids in (("r1", [4, 5]), ("r2", [20, 21])):
        drive(ledger, rid, S.DECODING, e)
        for pool in KvPool:
            ledger.claim_blocks(
                rid, "decode-0", epoch=e.decode, pool=pool, block_ids=block_ids, lease_ms=LEASE_MS
            )

    def resize(
        added: Sequence[int],
        removed: Sequence[int] = (),
        *,
        num_held: int,
        rid: str = "r1",
        epoch: int = e.decode,
        has_draft: bool = True,
    ) -> int:
        return ledger.resize_blocks(
            rid,
            "decode-0",
            epoch=epoch,
            num_held=num_held,
            added=added,
            removed=removed,
            has_draft=has_draft,
        )

    assert resize([6, 7], num_held=2) == 4
    many = range(100, 100 + 2500)  # more than one Lua unpack() batch
    assert resize(many, [4], num_held=4) == 2503
    r1 = {h.request_id: h for h in ledger.holdings()}["r1"]
    assert r1.blocks == {KvPool.TARGET: {5, 6, 7, *many}, KvPool.DRAFT: {5, 6, 7, *many}}
    assert resize([], many, num_held=2503, has_draft=False) == 3  # the draft pool is kept
    r1 = {h.request_id: h for h in ledger.holdings()}["r1"]
    assert r1.blocks == {KvPool.TARGET: {5, 6, 7}, KvPool.DRAFT: {5, 6, 7, *many}}
    ledger.free_blocks("r1", "decode-0", epoch=e.decode, pool=KvPool.DRAFT, block_ids=many)
    assert ledger.audit({"decode-0": {5, 6, 7, 20, 21}}) == []

    with pytest.raises(LedgerConflict, match="expected 4 blocks held by worker decode-0, found 3"):
        resize([8], num_held=4)  # an update this worker made was lost
    with pytest.raises(LedgerConflict, match="stale epoch: expected owner decode-0 at epoch"):
        resize([8], num_held=3, epoch=e.prefill)
    assert resize([], [5, 6, 7], num_held=3) == 0
    assert [h.request_id for h in ledger.holdings()] == ["r2"]
    with pytest.raises(LedgerConflict, match="expected blocks held by worker decode-0 at epoch"):
        resize([8], num_held=0)
    ledger.transition("r1", S.FINISHED, expected=S.DECODING, epoch=e.decode)
    with pytest.raises(LedgerConflict, match="r1: expected state DECODING, found FINISHED"):
        resize([8], num_held=0)
    ledger.client.delete(ledger.keys.request("r2", "decode-0")[2])  # r2's lease expired
    with pytest.raises(LedgerConflict, match="lease of worker decode-0 expected alive"):
        resize([8], num_held=2, rid="r2")
    assert {h.request_id: h.blocks[KvPool.TARGET] for h in ledger.holdings()} == {"r2": {20, 21}}


def test_expired_lease_is_reaped(ledger: Ledger) -> None:
    e = register(ledger)
    for rid in ("kept", "lost"):
        drive(ledger, rid, S.DECODING, e)
        ledger.claim_blocks(
            rid, "decode-0", epoch=e.decode, pool=KvPool.TARGET, block_ids=[1, 2], lease_ms=500
        )
        ledger.claim_blocks(
            rid, "decode-0", epoch=e.decode, pool=KvPool.DRAFT, block_ids=[1], lease_ms=500
        )
    assert ledger.reap_expired() == []
    for _ in range(5):  # "kept" is renewed past its first lease, "lost" is not
        time.sleep(0.15)
        ledger.renew_lease("kept", "decode-0", epoch=e.decode, lease_ms=500)
    with pytest.raises(
        LedgerConflict, match="lease of worker decode-0 expected alive, found expired"
    ):
        ledger.renew_lease("lost", "decode-0", epoch=e.decode, lease_ms=300)
    with pytest.raises(LedgerConflict, match="found expired"):
        ledger.claim_blocks(
            "lost", "decode-0", epoch=e.decode, pool=KvPool.TARGET, block_ids=[3], lease_ms=300
        )

    [reclaimed] = ledger.reap_expired()
    assert (reclaimed.request_id, reclaimed.worker_id, reclaimed.epoch) == (
        "lost",
        "decode-0",
        e.decode,
    )
    assert reclaimed.blocks == {KvPool.TARGET: {1, 2}, KvPool.DRAFT: {1}}
    assert ledger.reap_expired() == []
    assert [h.request_id for h in ledger.holdings()] == ["kept"]
    assert record_of(ledger, "lost").state is S.DECODING
    # Once "kept" is released, its index entry goes at the next reap after its lease.
    ledger.free_blocks("kept", "decode-0", epoch=e.decode)
    time.sleep(0.55)
    assert ledger.reap_expired() == []
    assert ledger.client.zcard(ledger.keys.holdings) == 0

"""Membership on a real Redis: heartbeats keep a registration and its leases alive; when
Redis forgets everything (restarted empty), the next heartbeat registers again with a new
epoch and drops what was held under the old one."""

from __future__ import annotations

import asyncio

from cluster.ledger import Ledger, WorkerRole
from cluster.membership import Membership, Timing


async def test_registers_again_with_a_new_epoch_when_redis_forgets_it(ledger: Ledger) -> None:
    lost: list[str] = []
    again: list[int] = []
    membership = Membership(
        ledger,
        "d0",
        role=WorkerRole.DECODE,
        address="127.0.0.1:1",
        capacity=8,
        timing=Timing(heartbeat_ms=50, lease_ms=200),
        load=lambda: (0.0, {"model": "m"}),
        on_lease_lost=lost.append,
        on_registered_again=again.append,
    )
    first = membership.register()
    ledger.create_request("r1", owner="router", epoch=1)
    membership.claim("r1", [1, 2], has_draft=False)
    membership.start()
    try:
        await asyncio.sleep(0.3)  # past the lease: renewals kept it
        assert lost == [] and again == [] and membership.is_holding("r1")

        for key in ledger.client.scan_iter(match=f"{ledger.ns}:*"):  # an empty restart
            ledger.client.delete(key)
        for _ in range(100):
            if again:
                break
            await asyncio.sleep(0.02)
        assert again == [membership.epoch] and membership.epoch > first
        assert lost == ["r1"] and not membership.is_holding("r1")
        assert [(w.worker_id, w.epoch) for w in ledger.list_workers()] == [("d0", again[0])]
    finally:
        await membership.stop()
    assert ledger.list_workers() == []

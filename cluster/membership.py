"""A component's presence in the ledger: registration (its epoch, the fencing token),
heartbeats carrying its load, and leases on the KV blocks it holds for requests.

Calls are synchronous redis-py calls on the event loop: each is one short round trip to
a local Redis, cheaper than a hop to a thread on a 2-core host.

A heartbeat that finds the registration gone (Redis restarted empty, or this process
stalled past the registration's TTL) registers again with a new epoch. What was held under
the old epoch is dropped (``on_lease_lost`` for each request): the ledger no longer knows
it, or no longer lets the old epoch move it. A Redis that cannot be reached is logged once
when it goes and once when it is back; the process keeps serving meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import redis

from cluster.ledger import Ledger, LedgerConflict, Pool, WorkerRole

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Timing:
    """Heartbeat period, registration TTL and block lease, in milliseconds."""

    heartbeat_ms: int = 2000
    lease_ms: int = 10_000

    @property
    def registration_ttl_ms(self) -> int:
        return 3 * self.heartbeat_ms

    def __post_init__(self) -> None:
        if self.heartbeat_ms <= 0 or self.lease_ms < 2 * self.heartbeat_ms:
            raise ValueError(
                f"lease_ms: must be at least twice heartbeat_ms (> 0), got {self.lease_ms} "
                f"and {self.heartbeat_ms}"
            )


class Membership:
    """Registers ``worker_id`` on ``start``, heartbeats and renews leases until ``stop``."""

    def __init__(
        self,
        ledger: Ledger,
        worker_id: str,
        *,
        role: WorkerRole,
        address: str,
        capacity: int,
        timing: Timing,
        load: Callable[[], tuple[float, Mapping[str, str | int | float]]],
        on_lease_lost: Callable[[str], None] = lambda request_id: None,
        on_registered_again: Callable[[int], None] = lambda epoch: None,
    ) -> None:
        self.ledger = ledger
        self.worker_id = worker_id
        self.role, self.address, self.capacity = role, address, capacity
        self.timing = timing
        self._load = load
        self._on_lease_lost = on_lease_lost
        self._on_registered_again = on_registered_again  # gets the new epoch
        self.epoch = 0
        self._is_redis_down = False
        self._held: dict[str, bool] = {}  # request id -> has draft blocks
        self._task: asyncio.Task[None] | None = None

    def register(self) -> int:
        """Registers with a fresh epoch (and heartbeats once); returns the epoch."""
        self.epoch = self.ledger.register_worker(
            self.worker_id,
            role=self.role,
            address=self.address,
            capacity=self.capacity,
            ttl_ms=self.timing.registration_ttl_ms,
        )
        self._heartbeat()
        return self.epoch

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"heartbeat-{self.worker_id}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        try:
            self.ledger.deregister_worker(self.worker_id, epoch=self.epoch)
        except (redis.RedisError, LedgerConflict) as e:
            log.warning("deregister: %s", e)

    # ---- blocks

    def claim(self, request_id: str, block_ids: Sequence[int], *, has_draft: bool) -> None:
        """Records the blocks this worker holds for a request (both pools share the ids)."""
        pools = (Pool.TARGET, Pool.DRAFT) if has_draft else (Pool.TARGET,)
        for pool in pools:
            self.ledger.claim_blocks(
                request_id,
                self.worker_id,
                epoch=self.epoch,
                pool=pool,
                block_ids=block_ids,
                lease_ms=self.timing.lease_ms,
            )
        self._held[request_id] = has_draft

    def release(self, request_id: str) -> None:
        """Forgets a request's blocks in the ledger. Idempotent; never raises."""
        if self._held.pop(request_id, None) is None:
            return
        try:
            self.ledger.release_blocks(request_id, self.worker_id, epoch=self.epoch)
        except (redis.RedisError, LedgerConflict) as e:
            log.warning("release %s: %s", request_id, e)

    def is_holding(self, request_id: str) -> bool:
        return request_id in self._held

    # ---- heartbeats

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.timing.heartbeat_ms / 1000)
            try:
                self._heartbeat()
                self._renew_leases()
            except redis.RedisError as e:
                if not self._is_redis_down:
                    log.warning("heartbeat: redis unreachable (%s); serving on, retrying", e)
                self._is_redis_down = True
                continue
            if self._is_redis_down:
                log.warning("heartbeat: redis reachable again")
                self._is_redis_down = False

    def _heartbeat(self) -> None:
        load, stats = self._load()
        try:
            self.ledger.heartbeat(
                self.worker_id,
                epoch=self.epoch,
                ttl_ms=self.timing.registration_ttl_ms,
                load=load,
                stats=stats,
            )
        except LedgerConflict as e:  # Redis restarted empty, or a long stall: register again
            self._register_again(str(e))

    def _register_again(self, why: str) -> None:
        old_epoch = self.epoch
        self.register()  # a RedisError leaves everything as it was, for the next heartbeat
        lost = list(self._held)
        self._held.clear()
        log.warning(
            "registration lost (%s): registered again at epoch %d (was %d); dropping %d "
            "requests held under the old epoch",
            why,
            self.epoch,
            old_epoch,
            len(lost),
        )
        self._on_registered_again(self.epoch)
        for request_id in lost:
            self._on_lease_lost(request_id)

    def _renew_leases(self) -> None:
        for request_id in list(self._held):
            try:
                self.ledger.renew_lease(
                    request_id, self.worker_id, epoch=self.epoch, lease_ms=self.timing.lease_ms
                )
            except LedgerConflict as e:
                log.warning("lease on %s lost: %s", request_id, e)
                self._held.pop(request_id, None)
                self._on_lease_lost(request_id)

"""A component's presence in the ledger: registration (its epoch, the fencing token),
heartbeats carrying its load, and leases on the KV blocks it holds for requests.

Calls are synchronous redis-py calls on the event loop: each is one short round trip to
a local Redis, cheaper than a hop to a thread on a 2-core host. A decode worker's tables
grow as it decodes (``resize``); the ledger follows once per turn of the event loop, not
on the engine's step, with one script per request whose blocks changed.

Each heartbeat first checks the ledger's generation (ledger.ledger.join_generation):

- another one, or none: Redis restarted empty (or was flushed), or was restored from a
  snapshot (the clock this component, or another, keeps there was behind what it had
  read last: a new generation began). The component registers again with a new epoch and
  records again what it holds (``Component.held_requests``: a decode worker's decoding requests,
  each in one script, owned by it at the new epoch, replacing what a snapshot brought
  back), so their streams go on; whatever it held that is not recorded again is dropped
  (``Component.on_lease_lost``).
- the same one, but the registration is gone: this process stalled past its TTL. It
  registers again and drops all it held: its leases may have been reclaimed and its
  requests taken over, so the old epoch must not move them.

Membership talks to the service it registers through the ``Component`` protocol (its
load, and what to do when the ledger loses track of what it holds); the service is
``attach``ed once built (it needs the membership to be built), before ``register``.

A Redis that cannot be reached is logged once when it goes and once when it is back; the
process keeps serving meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import redis

from ledger.ledger import Generation, KvPool, Ledger, LedgerConflict, WorkerRole

log = logging.getLogger(__name__)


# A registration outlives the start-up work between ``register`` and ``start`` (starting
# the engine thread, binding the port: over a second on a loaded machine), so that no
# router picks the worker under an epoch it is about to leave (a registration expired
# before the first heartbeat comes back under a new epoch).
STARTUP_TTL_MS = 10_000


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


@dataclass(frozen=True)
class HeldRequest:
    """A request a worker holds, as the ledger should record it again after it lost data
    (restarted empty, restored): the blocks the worker's allocator holds, record fields."""

    request_id: str
    block_ids: Sequence[int]
    fields: Mapping[str, str | int] = field(default_factory=dict)


class Component(Protocol):
    """What membership asks of the service it registers."""

    def load(self) -> tuple[float, Mapping[str, str | int | float]]:
        """Load in [0, 1] and figures ("model", ...), carried by every heartbeat."""
        ...

    def on_lease_lost(self, request_id: str) -> None:
        """The ledger no longer has this component holding ``request_id``: drop it here."""
        ...

    def on_registered(self, epoch: int) -> None:
        """Registered under ``epoch``: first, or again (Redis lost data, or a stall)."""
        ...

    async def held_requests(self) -> Sequence[HeldRequest]:
        """After the ledger lost data: the requests to record again at the new epoch."""
        ...


class _Unattached:
    """Stands in for the service until it is attached: no load, nothing held."""

    def load(self) -> tuple[float, Mapping[str, str | int | float]]:
        return 0.0, {}

    def on_lease_lost(self, request_id: str) -> None:
        pass

    def on_registered(self, epoch: int) -> None:
        pass

    async def held_requests(self) -> Sequence[HeldRequest]:
        return ()


@dataclass
class _Held:
    """A request this worker holds blocks for, as the ledger records them."""

    has_draft: bool  # the draft pool's blocks too (the same ids)
    block_ids: frozenset[int]


class Membership:
    """Registers ``worker_id``, heartbeats (from ``start``) and renews leases until ``stop``,
    telling its ``Component`` what the ledger lost."""

    def __init__(
        self,
        ledger: Ledger,
        worker_id: str,
        *,
        role: WorkerRole,
        address: str,
        capacity: int,
        timing: Timing,
        component: Component | None = None,
    ) -> None:
        self.ledger = ledger
        self.worker_id = worker_id
        self.role, self.address, self.capacity = role, address, capacity
        self.timing = timing
        self.component: Component = component or _Unattached()
        self.epoch = 0
        self.generation = Generation("", 0, 0)  # the ledger's, as this component read it
        self._is_redis_down = False
        self._held: dict[str, _Held] = {}
        # Allocator tables noted by ``resize``, not yet recorded in the ledger.
        self._tables: dict[str, Sequence[int]] = {}
        self._is_sync_due = False
        self._task: asyncio.Task[None] | None = None

    def attach(self, component: Component) -> None:
        """Heartbeats carry ``component``'s load from now on; it hears what the ledger lost."""
        self.component = component

    def register(self) -> int:
        """Joins the ledger's generation, registers with a fresh epoch and heartbeats once;
        returns the epoch, which the component hears too. The registration lasts
        STARTUP_TTL_MS, until ``start``'s heartbeats keep it to ``registration_ttl_ms``."""
        generation = self.ledger.join_generation(self.worker_id)
        ttl_ms = max(self.timing.registration_ttl_ms, STARTUP_TTL_MS)
        self.epoch = self.ledger.register_worker(
            self.worker_id,
            role=self.role,
            address=self.address,
            capacity=self.capacity,
            ttl_ms=ttl_ms,
        )
        self._send_heartbeat(ttl_ms)
        self.generation = generation  # a failure above is retried as a restart
        self.component.on_registered(self.epoch)
        return self.epoch

    def start(self) -> None:
        """Heartbeats now, then in the background. The one in ``register`` may predate the
        service (its load has no "model" yet): this one makes the registry show what the
        component serves before its health says SERVING, so a router sees every worker."""
        self._send_heartbeat()
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
        pools = (KvPool.TARGET, KvPool.DRAFT) if has_draft else (KvPool.TARGET,)
        for pool in pools:
            self.ledger.claim_blocks(
                request_id,
                self.worker_id,
                epoch=self.epoch,
                pool=pool,
                block_ids=block_ids,
                lease_ms=self.timing.lease_ms,
            )
        held = self._held.get(request_id)
        claimed = frozenset(block_ids) | (held.block_ids if held else frozenset())
        self._held[request_id] = _Held(has_draft, claimed)

    def resize(self, request_id: str, block_ids: Sequence[int]) -> None:
        """Notes that the allocator's table for a held request is now ``block_ids`` (grown
        or shrunk). The ledger is told off the caller's path: once the event loop has run
        what is ready (a decode step's outputs), for every request noted, one script per
        request whose blocks changed; while Redis is unreachable, at a later heartbeat."""
        self._tables[request_id] = block_ids
        if not self._is_sync_due and not self._is_redis_down:
            self._is_sync_due = True
            asyncio.get_running_loop().call_soon(self._sync_soon)

    def free(self, request_id: str) -> None:
        """Frees a request's blocks in the ledger (this worker's holding ends). Idempotent;
        never raises."""
        self._tables.pop(request_id, None)
        if self._held.pop(request_id, None) is None:
            return
        try:
            self.ledger.free_blocks(request_id, self.worker_id, epoch=self.epoch)
        except (redis.RedisError, LedgerConflict) as e:
            log.warning("free %s: %s", request_id, e)

    def is_holding(self, request_id: str) -> bool:
        return request_id in self._held

    # ---- heartbeats

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.timing.heartbeat_ms / 1000)
            try:
                await self._beat()
            except LedgerConflict as e:  # registering refused: Redis restarted meanwhile?
                log.warning("heartbeat: %s; retrying", e)
                continue
            except redis.RedisError as e:
                if not self._is_redis_down:
                    log.warning("heartbeat: redis unreachable (%s); serving on, retrying", e)
                self._is_redis_down = True
                continue
            if self._is_redis_down:
                log.warning("heartbeat: redis reachable again")
                self._is_redis_down = False

    async def _beat(self) -> None:
        """One heartbeat, lease renewal and what ``resize`` noted. The generation is looked
        at first, and again when something is refused: a refusal means "forgotten" after a
        restart, and "too late" after a stall, which call for different answers."""
        if self._is_ledger_new():
            await self._rebuild()
        else:
            try:
                self._send_heartbeat()
            except LedgerConflict as e:
                if self._is_ledger_new():  # restarted since the look above
                    await self._rebuild()
                else:
                    self._register_again(str(e))
            else:
                if not self._renew_leases():
                    await self._rebuild()
        self._sync_tables()  # noted while Redis was unreachable, or during a rebuild

    def _is_ledger_new(self) -> bool:
        """Whether the ledger's generation is not the one this component joined (a new one
        begins here if this component's clock in the ledger went back since its last look)."""
        generation = self.ledger.join_generation(self.worker_id, self.generation)
        if generation.id != self.generation.id:
            return True
        self.generation = generation
        return False

    def publish_figures(self) -> None:
        """A heartbeat now, out of turn: figures routers must see at once (an adapter
        loaded). Redis out of reach: the next heartbeat publishes them."""
        try:
            self._send_heartbeat()
        except (redis.RedisError, LedgerConflict) as e:
            log.warning("heartbeat out of turn: %s; the next one publishes the figures", e)

    def _send_heartbeat(self, ttl_ms: int | None = None) -> None:
        load, stats = self.component.load()
        self.ledger.heartbeat(
            self.worker_id,
            epoch=self.epoch,
            ttl_ms=ttl_ms or self.timing.registration_ttl_ms,
            load=load,
            stats=stats,
        )

    async def _rebuild(self) -> None:
        """The ledger lost data (restarted empty, or restored): registers again, then
        records again, at the new epoch, the requests the component names among those
        held; the others are dropped. Requests claimed after registering (under the new
        epoch) are kept."""
        old_epoch, old_generation = self.epoch, self.generation
        self.register()  # a RedisError leaves everything as it was, for the next heartbeat
        held, self._held = self._held, {}
        try:
            for request in await self._held_now():
                self._restore(request, held.get(request.request_id))
        finally:  # a RedisError midway drops the rest: the ledger does not know them
            lost = [rid for rid in held if rid not in self._held]
            log.warning(
                "the ledger lost data, Redis restarted empty or restored (generation %s, was "
                "%s): registered again at epoch %d (was %d); %d requests recorded again, %d "
                "dropped",
                self.generation.id,
                old_generation.id,
                self.epoch,
                old_epoch,
                len(held) - len(lost),
                len(lost),
            )
            for request_id in lost:
                self.component.on_lease_lost(request_id)

    async def _held_now(self) -> Sequence[HeldRequest]:
        """The component's ``held_requests``; none when it fails (the heartbeat goes on)."""
        try:
            return await self.component.held_requests()
        except Exception:
            log.exception("after a Redis restart: cannot list the requests held")
            return ()

    def _restore(self, request: HeldRequest, old: _Held | None) -> None:
        """Records ``request`` again at this epoch, if it was held under the old one
        (``old``) and not claimed since."""
        if old is None or request.request_id in self._held:
            return
        try:
            self.ledger.restore_decoding(
                request.request_id,
                self.worker_id,
                epoch=self.epoch,
                block_ids=request.block_ids,
                has_draft=old.has_draft,
                lease_ms=self.timing.lease_ms,
                fields=request.fields,
                stale_before_ms=self.generation.started_ms,
            )
        except LedgerConflict as e:  # recorded meanwhile: not this worker's any more
            log.warning("%s: not recorded again: %s", request.request_id, e)
            return
        self._held[request.request_id] = _Held(old.has_draft, frozenset(request.block_ids))

    def _register_again(self, why: str) -> None:
        """The registration expired while the ledger lived on (a stall): registers again
        and drops all that was held under the old epoch."""
        old_epoch = self.epoch
        self.register()  # a RedisError leaves everything as it was, for the next heartbeat
        lost = list(self._held)
        self._held.clear()
        self._tables.clear()
        log.warning(
            "registration lost (%s): registered again at epoch %d (was %d); dropping %d "
            "requests held under the old epoch",
            why,
            self.epoch,
            old_epoch,
            len(lost),
        )
        for request_id in lost:
            self.component.on_lease_lost(request_id)

    def _renew_leases(self) -> bool:
        """Renews every lease; False, renewing no more, when a refusal turns out to mean
        that the ledger restarted."""
        for request_id in list(self._held):
            try:
                self.ledger.renew_lease(
                    request_id, self.worker_id, epoch=self.epoch, lease_ms=self.timing.lease_ms
                )
            except LedgerConflict as e:
                if self._is_ledger_new():
                    return False
                log.warning("lease on %s lost: %s", request_id, e)
                self._drop(request_id)
        return True

    def _sync_soon(self) -> None:
        """``resize``'s call, once the event loop has run what was ready."""
        self._is_sync_due = False
        try:
            self._sync_tables()
        except redis.RedisError as e:  # the heartbeat tries again
            if not self._is_redis_down:
                log.warning("blocks: redis unreachable (%s); serving on, retrying", e)
            self._is_redis_down = True

    def _sync_tables(self) -> None:
        """Records the tables ``resize`` noted, one script per held request whose blocks
        changed. A refusal after a restart leaves them to the rebuild; any other means that
        the ledger no longer has this worker holding the request, which is dropped."""
        for request_id, table in list(self._tables.items()):
            held = self._held.get(request_id)
            if held is None:
                continue  # not recorded again (yet) after a restart: kept until freed
            block_ids = frozenset(table)
            if block_ids != held.block_ids:
                try:
                    self.ledger.resize_blocks(
                        request_id,
                        self.worker_id,
                        epoch=self.epoch,
                        num_held=len(held.block_ids),
                        added=sorted(block_ids - held.block_ids),
                        removed=sorted(held.block_ids - block_ids),
                        has_draft=held.has_draft,
                    )
                except LedgerConflict as e:
                    if self._is_ledger_new():
                        return
                    log.warning("blocks of %s not recorded, dropping it: %s", request_id, e)
                    self.free(request_id)  # what the ledger still has this worker hold
                    self.component.on_lease_lost(request_id)
                    continue
                held.block_ids = block_ids
            del self._tables[request_id]

    def _drop(self, request_id: str) -> None:
        """The ledger no longer has this worker holding the request (its lease expired)."""
        self._held.pop(request_id, None)
        self._tables.pop(request_id, None)
        self.component.on_lease_lost(request_id)

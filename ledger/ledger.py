"""The Redis ledger: request state, KV block ownership under leases, worker registry.

Redis holds soft state with TTLs; workers hold the truth of their memory (see
ledger.audit). Every state change is one Lua script (ledger.scripts) over the
keys of one request or one worker, so the ledger runs on one Redis or on Redis Cluster.

Keys: ``ledger.keys``.

Fencing: a request record holds its owner's epoch; a transition must present it. Epochs
come from one counter, so an epoch names one registration of one worker: a worker that
restarted, or a request that moved on, refuses the stale holder.

Restarts: a component that finds another generation than the one it joined, or its own
clock in the ledger gone back, knows the ledger lost data (``join_generation``); decode
workers then record again what they are decoding (``restore_decoding``; ledger.membership).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from typing import Any

import redis
from redis.commands.core import Script

from ledger import scripts as lua
from ledger.audit import AllocatorReport, Discrepancy, find_discrepancies
from ledger.keys import LedgerKeys
from ledger.prefix_index import PrefixIndex
from ledger.records import (
    ALLOWED_TRANSITIONS,
    DEFAULT_FINISHED_TTL_MS,
    DEFAULT_REQUEST_TTL_MS,
    RECORD_FIELDS,
    WORKER_FIELDS,
    Generation,
    Holding,
    KvPool,
    LedgerConflict,
    Reclaimed,
    RedisClient,
    RequestRecord,
    RequestState,
    WorkerInfo,
    WorkerRole,
    check_block_ids,
    check_id,
    pairs_of,
    text_of,
)


class Ledger:
    """Typed access to the ledger; ``client`` is a redis-py Redis or RedisCluster client."""

    def __init__(
        self,
        client: RedisClient,
        *,
        namespace: str = "td",
        request_ttl_ms: int = DEFAULT_REQUEST_TTL_MS,
        finished_ttl_ms: int = DEFAULT_FINISHED_TTL_MS,
    ) -> None:
        if not namespace or "{" in namespace or "}" in namespace:
            raise ValueError(f"namespace: non-empty, without braces, got {namespace!r}")
        self.client = client
        self.ns = namespace
        self.request_ttl_ms = request_ttl_ms
        self.finished_ttl_ms = finished_ttl_ms
        self._scripts: dict[str, Script] = {}
        self.prefixes = PrefixIndex(client, namespace)
        self.keys = LedgerKeys(namespace)

    # ---- scripts

    def _run(self, source: str, keys: Sequence[str], args: Sequence[Any]) -> Any:
        """Runs a script (EVALSHA, loaded on first use); a refusal raises LedgerConflict."""
        script = self._scripts.get(source)
        if script is None:
            script = self._scripts[source] = self.client.register_script(source)
        try:
            return script(keys=list(keys), args=list(args))
        except redis.ResponseError as e:
            message = str(e)
            if lua.CONFLICT_TAG in message:
                raise LedgerConflict(message.split(lua.CONFLICT_TAG, 1)[1].strip()) from None
            raise

    # ---- requests

    def create_request(
        self,
        request_id: str,
        *,
        owner: str,
        epoch: int,
        fields: Mapping[str, str | int | float] | None = None,
    ) -> RequestRecord:
        """Records a new request in QUEUED, owned by ``owner`` (the router) at ``epoch``.
        LedgerConflict when the id has a record, unless that request FAILED ``retryable``
        (its client was told to retry): the new record replaces it."""
        check_id("request_id", request_id)
        check_id("owner", owner)
        extra: list[str] = []
        for name, value in (fields or {}).items():
            if name in RECORD_FIELDS:
                raise ValueError(f"fields: {name!r} is reserved ({sorted(RECORD_FIELDS)})")
            extra += [name, str(value)]
        flat = self._run(
            lua.CREATE_REQUEST,
            [self.keys.record(request_id)],
            [request_id, owner, epoch, self.request_ttl_ms, *extra],
        )
        return RequestRecord.from_redis(request_id, pairs_of(flat))

    def get_request(self, request_id: str) -> RequestRecord | None:
        check_id("request_id", request_id)
        flat = self.client.hgetall(self.keys.record(request_id))
        if not flat:
            return None
        return RequestRecord.from_redis(
            request_id, {text_of(k): text_of(v) for k, v in flat.items()}
        )

    def transition(
        self,
        request_id: str,
        to: RequestState,
        *,
        expected: RequestState,
        epoch: int,
        new_owner: str | None = None,
        new_epoch: int | None = None,
        error: str | None = None,
        retryable: bool = False,
    ) -> RequestRecord:
        """Moves a request from ``expected`` to ``to`` if it is there and ``epoch`` is its
        owner's; ``new_owner``/``new_epoch`` hand it over (e.g. router -> prefill worker).
        ``retryable`` (to FAILED only): the client was told to retry, so a new request may
        take the same id (``create_request``)."""
        check_id("request_id", request_id)
        expected, to = RequestState(expected), RequestState(to)
        if to not in ALLOWED_TRANSITIONS[expected]:
            allowed = ", ".join(sorted(ALLOWED_TRANSITIONS[expected])) or "none (terminal)"
            raise LedgerConflict(
                f"request {request_id}: illegal transition {expected} -> {to}; "
                f"from {expected} allowed: {allowed}"
            )
        if (new_owner is None) != (new_epoch is None):
            raise ValueError("new_owner and new_epoch: give both or neither")
        if new_owner is not None:
            check_id("new_owner", new_owner)
        if retryable and to is not RequestState.FAILED:
            raise ValueError(f"retryable: only a request that FAILED is retried, not {to}")
        ttl = self.finished_ttl_ms if to.is_terminal else self.request_ttl_ms
        args = [request_id, expected, to, epoch, new_owner or "", new_epoch or 0, ttl, error or ""]
        args.append("1" if retryable else "")
        flat = self._run(lua.TRANSITION, [self.keys.record(request_id)], args)
        return RequestRecord.from_redis(request_id, pairs_of(flat))

    def restore_decoding(
        self,
        request_id: str,
        worker_id: str,
        *,
        epoch: int,
        block_ids: Iterable[int],
        has_draft: bool,
        lease_ms: int,
        fields: Mapping[str, str | int | float] | None = None,
        stale_before_ms: int = 0,
    ) -> RequestRecord:
        """Records again, after the ledger lost its data, a request that decode worker
        ``worker_id`` is decoding: DECODING, owned by it at ``epoch`` (its new one),
        holding ``block_ids`` (target, and draft if ``has_draft``) under a lease, with
        ``fields`` (model, num_prompt_tokens...) and the server time in ``restored_ms``.
        A record last changed before ``stale_before_ms`` (the generation's start: a Redis
        restored from a snapshot brings back old records) and not ended is replaced;
        LedgerConflict for any other: recorded meanwhile, not this worker's to overwrite.
        One script over the request's keys (it runs on Redis Cluster)."""
        check_id("request_id", request_id)
        check_id("worker_id", worker_id)
        ids = check_block_ids(block_ids)
        extra: list[str] = []
        for name, value in (fields or {}).items():
            if name in RECORD_FIELDS or name == "restored_ms":
                raise ValueError(f"fields: {name!r} is reserved ({sorted(RECORD_FIELDS)})")
            extra += [name, str(value)]
        record, holders, lease, target, draft = self.keys.request(request_id, worker_id)
        if ids:  # index first, as claim_blocks does: the reaper must be able to find it
            member = f"{request_id}/{worker_id}"
            self.client.zadd(self.keys.holdings, {member: self._expiry_hint(lease_ms)})
        args = [request_id, worker_id, epoch, self.request_ttl_ms, lease_ms, int(has_draft)]
        flat = self._run(
            lua.RESTORE_DECODING,
            [record, holders, lease, target, draft],
            [*args, stale_before_ms, len(extra), *extra, *ids],
        )
        return RequestRecord.from_redis(request_id, pairs_of(flat))

    # ---- blocks and leases

    def claim_blocks(
        self,
        request_id: str,
        worker_id: str,
        *,
        epoch: int,
        pool: KvPool,
        block_ids: Iterable[int],
        lease_ms: int,
    ) -> int:
        """Records that ``worker_id`` (at ``epoch``) holds ``block_ids`` of ``pool`` for a
        live request, adding to what it already holds, and (re)starts its lease.
        Returns the number of blocks it now holds in that pool."""
        check_id("request_id", request_id)
        check_id("worker_id", worker_id)
        ids = check_block_ids(block_ids)
        record, holders, lease, target, draft = self.keys.request(request_id, worker_id)
        pool_set = target if KvPool(pool) is KvPool.TARGET else draft
        # Index first (NX: a failed claim must not postpone the reaper), then the truth, then
        # the hint: a crash in between leaves an index entry the reaper drops, never a
        # holding the reaper cannot find.
        member = f"{request_id}/{worker_id}"
        self.client.zadd(self.keys.holdings, {member: self._expiry_hint(lease_ms)}, nx=True)
        keys = [record, holders, pool_set, lease, target, draft]
        held = self._run(lua.CLAIM_BLOCKS, keys, [request_id, worker_id, epoch, lease_ms, *ids])
        self._index(request_id, worker_id, lease_ms)
        return int(held)

    def resize_blocks(
        self,
        request_id: str,
        worker_id: str,
        *,
        epoch: int,
        num_held: int,
        added: Iterable[int],
        removed: Iterable[int],
        has_draft: bool,
        expected: RequestState = RequestState.DECODING,
    ) -> int:
        """Records that the allocator of ``worker_id``, the request's owner at ``epoch``,
        grew or shrank its table: ``added`` and ``removed`` block ids, in the target pool
        and, if ``has_draft``, the draft pool. LedgerConflict unless the request is in
        ``expected`` and owned by the worker at ``epoch``, its lease is alive and the ledger
        holds ``num_held`` target blocks for it (what the worker recorded last). Returns
        the number of target blocks now held; none ends the holding, as ``free_blocks`` does."""
        check_id("request_id", request_id)
        check_id("worker_id", worker_id)
        added_ids, removed_ids = check_block_ids(added), check_block_ids(removed)
        record, holders, lease, target, draft = self.keys.request(request_id, worker_id)
        args = [request_id, worker_id, epoch, RequestState(expected), num_held, int(has_draft)]
        held = self._run(
            lua.RESIZE_BLOCKS,
            [record, holders, lease, target, draft],
            [*args, len(added_ids), *added_ids, *removed_ids],
        )
        return int(held)

    def free_blocks(
        self,
        request_id: str,
        worker_id: str,
        *,
        epoch: int,
        pool: KvPool | None = None,
        block_ids: Iterable[int] | None = None,
    ) -> int:
        """Forgets blocks of a worker for a request: ``block_ids`` of ``pool``, or all of
        ``pool``, or all (pool None). Returns how many were freed. Idempotent."""
        check_id("request_id", request_id)
        check_id("worker_id", worker_id)
        ids = None if block_ids is None else check_block_ids(block_ids)
        if ids == []:
            return 0
        if ids is not None and pool is None:
            raise ValueError("block_ids: give the pool they belong to")
        _, holders, lease, target, draft = self.keys.request(request_id, worker_id)
        pool_arg = "" if pool is None else str(KvPool(pool))
        freed, _remaining = self._run(
            lua.FREE_BLOCKS,
            [holders, lease, target, draft],
            [request_id, worker_id, epoch, pool_arg, *(ids or [])],
        )
        # The holdings index entry stays: only the reaper drops entries (race-free, see
        # UNINDEX_IF_SCORE), once their expiry hint has passed.
        return int(freed)

    def renew_lease(self, request_id: str, worker_id: str, *, epoch: int, lease_ms: int) -> None:
        """Extends a worker's lease on a request's blocks; LedgerConflict once it expired
        (the worker must then abort the request: its blocks may be reclaimed)."""
        check_id("request_id", request_id)
        check_id("worker_id", worker_id)
        _, holders, lease, _, _ = self.keys.request(request_id, worker_id)
        self._run(lua.RENEW_LEASE, [holders, lease], [request_id, worker_id, epoch, lease_ms])
        self._index(request_id, worker_id, lease_ms)

    def _index(self, request_id: str, worker_id: str, lease_ms: int) -> None:
        """Sets the reaper's expiry hint of a lease just (re)started for ``lease_ms``."""
        member = f"{request_id}/{worker_id}"
        self.client.zadd(self.keys.holdings, {member: self._expiry_hint(lease_ms)})

    @staticmethod
    def _expiry_hint(lease_ms: int) -> int:
        # Client clock: only a hint; the reaper checks the lease key itself.
        return int(time.time() * 1000) + lease_ms

    def reap_expired(self, limit: int = 1000) -> list[Reclaimed]:
        """Reclaims the blocks of expired leases (at most ``limit`` index entries looked at).
        Request states are left alone: the caller decides (migrate, fail)."""
        now = int(time.time() * 1000)
        due: Any = self.client.zrangebyscore(
            self.keys.holdings, "-inf", now, start=0, num=limit, withscores=True
        )
        reclaimed: list[Reclaimed] = []
        for raw_member, score in due:
            member = text_of(raw_member)
            request_id, worker_id = member.split("/", 1)
            _, holders, lease, target, draft = self.keys.request(request_id, worker_id)
            result = self._run(lua.REAP, [holders, lease, target, draft], [worker_id])
            outcome = text_of(result[0])
            if outcome == "alive":
                expiry = now + int(result[1])
                self.client.zadd(self.keys.holdings, {member: expiry})
                continue
            self._run(lua.UNINDEX_IF_SCORE, [self.keys.holdings], [member, int(score)])
            if outcome == "reclaimed":
                blocks = {
                    KvPool.TARGET: frozenset(int(b) for b in result[2]),
                    KvPool.DRAFT: frozenset(int(b) for b in result[3]),
                }
                reclaimed.append(Reclaimed(request_id, worker_id, int(result[1]), blocks))
        return reclaimed

    def holdings(self, worker_id: str | None = None) -> list[Holding]:
        """Every (request, worker) holding in the index, or only ``worker_id``'s."""
        holdings = []
        for raw_member in self.client.zrange(self.keys.holdings, 0, -1):
            request_id, holder = text_of(raw_member).split("/", 1)
            if worker_id is not None and holder != worker_id:
                continue
            record, holders, lease, target, draft = self.keys.request(request_id, holder)
            epoch, pttl, target_ids, draft_ids, state = self._run(
                lua.READ_HOLDING, [holders, lease, target, draft, record], [holder]
            )
            if epoch is None:
                continue  # freed, index entry not yet dropped
            holdings.append(
                Holding(
                    request_id=request_id,
                    worker_id=holder,
                    epoch=int(epoch),
                    blocks={
                        KvPool.TARGET: frozenset(int(b) for b in target_ids),
                        KvPool.DRAFT: frozenset(int(b) for b in draft_ids),
                    },
                    lease_ttl_ms=int(pttl),
                    request_state=None if state is None else RequestState(text_of(state)),
                )
            )
        return holdings

    # ---- workers

    def join_generation(self, worker_id: str, seen: Generation | None = None) -> Generation:
        """The ledger's generation, with ``worker_id``'s clock advanced by one. A new one
        begins when Redis has none (new, restarted empty or flushed), or when it has
        ``seen`` (what this worker read last) but the worker's clock is not past it: the
        data went back in time (restored from a snapshot). A component that finds another
        id than the one it joined knows the ledger lost data since, which a refused
        heartbeat alone cannot tell from a stall past the registration's TTL."""
        check_id("worker_id", worker_id)
        args = [secrets.token_hex(8), worker_id]
        args += [seen.id, str(seen.tick)] if seen else ["", "0"]
        generation_id, started_ms, tick = self._run(
            lua.JOIN_GENERATION, [self.keys.generation], args
        )
        return Generation(text_of(generation_id), int(started_ms), int(tick))

    def register_worker(
        self,
        worker_id: str,
        *,
        role: WorkerRole,
        address: str,
        capacity: int,
        ttl_ms: int,
    ) -> int:
        """Registers (or re-registers) a worker with a fresh epoch, its fencing token."""
        check_id("worker_id", worker_id)
        epoch = int(self._run(lua.NEXT_EPOCH, [self.keys.epoch], []))
        fields = ["role", str(WorkerRole(role)), "address", address, "capacity", capacity]
        fields += ["load", 0.0]
        self._run(
            lua.REGISTER_WORKER, [self.keys.worker(worker_id)], [worker_id, epoch, ttl_ms, *fields]
        )
        self.client.sadd(self.keys.workers, worker_id)
        return epoch

    def heartbeat(
        self,
        worker_id: str,
        *,
        epoch: int,
        ttl_ms: int,
        load: float,
        stats: Mapping[str, str | int | float] | None = None,
    ) -> None:
        """Keeps a registration alive; LedgerConflict if it expired or the epoch is stale
        (the worker must register again and drop what it held under the old epoch)."""
        check_id("worker_id", worker_id)
        fields: list[str | float] = ["load", float(load)]
        for name, value in (stats or {}).items():
            if name in WORKER_FIELDS:
                raise ValueError(f"stats: {name!r} is reserved ({sorted(WORKER_FIELDS)})")
            fields += [name, str(value)]
        self._run(lua.HEARTBEAT, [self.keys.worker(worker_id)], [worker_id, epoch, ttl_ms, *fields])
        self.client.sadd(self.keys.workers, worker_id)  # repairs a racing prune

    def deregister_worker(self, worker_id: str, *, epoch: int) -> bool:
        """Removes a registration (graceful shutdown); False if it had already expired."""
        check_id("worker_id", worker_id)
        removed = self._run(
            lua.DEREGISTER_WORKER, [self.keys.worker(worker_id)], [worker_id, epoch]
        )
        self.client.srem(self.keys.workers, worker_id)
        return bool(removed)

    def list_workers(self, role: WorkerRole | None = None) -> list[WorkerInfo]:
        """Live registrations (heartbeat TTL not expired), sorted by id."""
        workers = []
        for worker_id in sorted(text_of(w) for w in self.client.smembers(self.keys.workers)):
            raw = {
                text_of(k): text_of(v)
                for k, v in self.client.hgetall(self.keys.worker(worker_id)).items()
            }
            if not raw:
                self.client.srem(self.keys.workers, worker_id)  # expired: prune the index
                continue
            info = WorkerInfo(
                worker_id=worker_id,
                role=WorkerRole(raw["role"]),
                address=raw["address"],
                capacity=int(raw["capacity"]),
                load=float(raw["load"]),
                epoch=int(raw["epoch"]),
                registered_ms=int(raw["registered_ms"]),
                heartbeat_ms=int(raw["heartbeat_ms"]),
                stats={k: v for k, v in raw.items() if k not in WORKER_FIELDS},
            )
            if role is None or info.role is WorkerRole(role):
                workers.append(info)
        return workers

    # ---- audit

    def audit(self, reports: Mapping[str, AllocatorReport | AbstractSet[int]]) -> list[Discrepancy]:
        """Compares the ledger's holdings with workers' allocator reports (ledger.audit)."""
        registered = {w.worker_id for w in self.list_workers()}
        return find_discrepancies(self.holdings(), reports, registered)

"""The prefix index: which workers cache the KV blocks of a chain of content hashes, a
hint for KV-aware routing. Plain commands with expiring entries, apart from the ledger's
request and worker state (nothing here is fenced: a stale hint costs a cache miss)."""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

from ledger.records import PREFIX_KEY_TTL_MS, RedisClient, check_id, text_of


class PrefixIndex:
    """``{ns}:prefix:HASH``: a zset of worker id -> expiry (ms) per cached KV block."""

    def __init__(self, client: RedisClient, namespace: str) -> None:
        self.client = client
        self.ns = namespace

    def publish(
        self, worker_ids: Iterable[str], block_hashes: Iterable[str], *, ttl_ms: int
    ) -> None:
        """Advertises that each of ``worker_ids`` caches the KV blocks with these content
        hashes (one pipelined round trip; each block's key may live on another node)."""
        workers = list(worker_ids)
        for worker_id in workers:
            check_id("worker_id", worker_id)
        keys = [self._key(h) for h in block_hashes]
        if not keys:
            return
        # Plain commands, not a script: cluster pipelines refuse EVALSHA. Entries expire by
        # score (this host's clock: a routing hint tolerates skew); the key itself lives at
        # least PREFIX_KEY_TTL_MS (garbage collection only: without PEXPIRE GT, which 6.2
        # lacks, a short-lived entry must not cut the others' key short).
        now = int(time.time() * 1000)
        key_ttl = max(ttl_ms, PREFIX_KEY_TTL_MS)
        with self.client.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.zremrangebyscore(key, "-inf", now)
                pipe.zadd(key, dict.fromkeys(workers, now + ttl_ms))
                pipe.pexpire(key, key_ttl)
            pipe.execute()

    def withdraw(self, worker_id: str, block_hashes: Iterable[str]) -> None:
        """Withdraws advertised blocks (evicted from the worker's prefix cache)."""
        for block_hash in block_hashes:
            self.client.zrem(self._key(block_hash), worker_id)

    def match(self, block_hashes: Sequence[str]) -> dict[str, int]:
        """For each worker, how many leading blocks of this chain of hashes it caches
        (one pipelined round trip)."""
        keys = [self._key(h) for h in block_hashes]
        if not keys:
            return {}
        now = int(time.time() * 1000)
        with self.client.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.zrangebyscore(key, f"({now}", "+inf")
            found = pipe.execute()
        matched: dict[str, int] = {}
        candidates: set[str] | None = None
        for i, workers in enumerate(found):
            names = {text_of(w) for w in workers}
            candidates = names if candidates is None else candidates & names
            if not candidates:
                break
            for worker_id in candidates:
                matched[worker_id] = i + 1
        return matched

    def _key(self, block_hash: str) -> str:
        check_id("block_hash", block_hash)
        return f"{self.ns}:prefix:{block_hash}"

"""Which prefill and decode worker serve a request: the least loaded live ones.

Load comes from the ledger's worker registry (each worker heartbeats the figures its Stats
reports); between heartbeats the requests this router has sent a worker count too, and
equal scores take turns.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import Counter

from cluster.ledger import Ledger, WorkerInfo, WorkerRole
from cluster.rpc import Unavailable

IN_FLIGHT_WEIGHT = 0.01  # score per request this router has in flight on a worker


class WorkerPicker:
    def __init__(
        self, ledger: Ledger, model: str, *, refresh_s: float = 0.25, wait_s: float = 5.0
    ) -> None:
        self.ledger = ledger
        self.model = model
        self.refresh_s = refresh_s
        self.wait_s = wait_s  # how long a request waits for a live worker before UNAVAILABLE
        self.in_flight: Counter[str] = Counter()
        self._turn = itertools.count()
        self._workers: list[WorkerInfo] = []
        self._fetched_at = -1e9

    def workers(self, role: WorkerRole) -> list[WorkerInfo]:
        """Live workers of ``role`` serving this model, not draining (cached briefly)."""
        if time.monotonic() - self._fetched_at > self.refresh_s:
            self._workers = self.ledger.list_workers()
            self._fetched_at = time.monotonic()
        return [
            w
            for w in self._workers
            if w.role is role
            and w.stats.get("model") == self.model
            and w.stats.get("draining", "0") == "0"
        ]

    def pick(self) -> tuple[WorkerInfo, WorkerInfo]:
        """A (prefill, decode) pair with the same draft fingerprint."""
        prefill = self._least_loaded(self.workers(WorkerRole.PREFILL), WorkerRole.PREFILL)
        return prefill, self._least_loaded(self.decoders_for(prefill), WorkerRole.DECODE)

    def decoders_for(self, prefill: WorkerInfo) -> list[WorkerInfo]:
        """Live decode workers that can take KV from ``prefill`` (same draft fingerprint)."""
        fingerprint = prefill.stats.get("draft_fingerprint", "")
        return [
            w
            for w in self.workers(WorkerRole.DECODE)
            if w.stats.get("draft_fingerprint", "") == fingerprint
        ]

    def least_loaded(self, decoders: list[WorkerInfo]) -> WorkerInfo:
        return self._least_loaded(decoders, WorkerRole.DECODE)

    async def pick_waiting(self, deadline: float) -> tuple[WorkerInfo, WorkerInfo]:
        """``pick``, re-reading the registry while no pair is live, for at most ``wait_s``
        and never past ``deadline`` (monotonic): a worker restarting or a heartbeat late
        under load costs the request latency, not an error."""
        give_up = min(deadline, time.monotonic() + self.wait_s)
        while True:
            try:
                return self.pick()
            except Unavailable:
                if time.monotonic() + self.refresh_s > give_up:
                    raise
            self.forget_stale()
            await asyncio.sleep(self.refresh_s)

    def _least_loaded(self, workers: list[WorkerInfo], role: WorkerRole) -> WorkerInfo:
        if not workers:
            raise Unavailable(f"no live {role} worker serves model {self.model!r}; retry later")
        turn = next(self._turn)
        n = len(workers)
        scored = [
            (w.load + IN_FLIGHT_WEIGHT * self.in_flight[w.worker_id], (i - turn) % n, w)
            for i, w in enumerate(workers)
        ]
        return min(scored, key=lambda s: (s[0], s[1]))[2]

    def forget_stale(self) -> None:
        """Re-reads the registry on the next pick (a worker refused or vanished)."""
        self._fetched_at = -1e9

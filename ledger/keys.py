"""Where the ledger keeps what, in Redis: every key's name, under a namespace (the
prefix index names its own keys: ``ledger.prefix_index``).

Keys, under a namespace ``ns`` (default "td"):

    {ns}:{req:ID}                         hash: state, owner, epoch, version, times, fields
    {ns}:{req:ID}:holders                 hash: worker id -> epoch of the instance holding blocks
    {ns}:{req:ID}:blocks:WORKER:POOL      set of block ids held by WORKER in POOL (claimed, then
                                          resized as the owner's allocator grows its table)
    {ns}:{req:ID}:lease:WORKER            string (epoch) with the lease TTL
    {ns}:holdings                         zset "ID/WORKER" -> lease expiry hint (ms), for the reaper
    {ns}:epoch                            counter of registration epochs (fencing tokens)
    {ns}:generation                       hash: id, started_ms, tick:WORKER (this lifetime of the
                                          data, and each component's clock)
    {ns}:workers                          set of worker ids (index of the records below)
    {ns}:worker:WORKER                    hash: role, address, capacity, load, epoch (heartbeat TTL)
    {ns}:prefix:HASH                      the prefix index (ledger.prefix_index)

A request's keys share its hash tag ``{req:ID}``, so one script over them runs on Redis
Cluster.
"""

from __future__ import annotations

from ledger.records import KvPool


class LedgerKeys:
    """The key names under namespace ``ns``."""

    def __init__(self, ns: str) -> None:
        self.ns = ns

    def record(self, request_id: str) -> str:
        return f"{self.ns}:{{req:{request_id}}}"

    def request(self, request_id: str, worker_id: str) -> tuple[str, str, str, str, str]:
        """record, holders, lease, target set, draft set of one (request, worker)."""
        record = self.record(request_id)
        blocks = f"{record}:blocks:{worker_id}"
        return (
            record,
            f"{record}:holders",
            f"{record}:lease:{worker_id}",
            f"{blocks}:{KvPool.TARGET}",
            f"{blocks}:{KvPool.DRAFT}",
        )

    def worker(self, worker_id: str) -> str:
        return f"{self.ns}:worker:{worker_id}"

    @property
    def holdings(self) -> str:
        return f"{self.ns}:holdings"

    @property
    def generation(self) -> str:
        return f"{self.ns}:generation"

    @property
    def epoch(self) -> str:
        return f"{self.ns}:epoch"

    @property
    def workers(self) -> str:
        return f"{self.ns}:workers"

"""Ledger audit: compare the ledger's block holdings with what workers' allocators report.

Workers hold the truth of their memory; the ledger is soft state. A discrepancy is a
leak on one side (blocks one side thinks are held and the other does not), a block
held twice, or a holding that outlived its request or its worker. `tandem ledger audit`
prints these; nothing here repairs anything.

A live cluster grants and frees blocks while it is looked at: the ledger follows an
allocator within a turn of the worker's event loop, so a block granted or freed between
reading the allocator and reading the ledger shows on one side only, once. Several looks
tell that from a leak, which shows in every one (``seen_in_every_look``).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable, Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field, replace
from enum import StrEnum

from ledger.records import Holding


class DiscrepancyKind(StrEnum):
    LEDGER_ONLY = "ledger_only"  # the ledger says held, the worker does not own them
    WORKER_ONLY = "worker_only"  # the worker owns them, no ledger holding on that worker
    CACHED_BUT_HELD = "cached_but_held"  # the worker lists them as free cached blocks
    DOUBLE_HELD = "double_held"  # more requests hold a block id than its worker counts
    DEAD_WORKER = "dead_worker"  # held by a worker neither registered nor reporting
    ENDED_REQUEST = "ended_request"  # held for a request that is terminal or expired


@dataclass(frozen=True)
class AllocatorReport:
    """One worker's allocator: block ids in use, how many requests hold each where more
    than one does (requests sharing a cached prefix; 1 where absent), and free ones holding
    a cached prefix. One id addresses a target and a draft block, so pools are not told
    apart."""

    owned: frozenset[int]
    cached: frozenset[int] = frozenset()
    ref_counts: Mapping[int, int] = field(default_factory=dict, compare=False)

    @classmethod
    def counted(cls, owned: Sequence[int], ref_counts: Sequence[int]) -> AllocatorReport:
        """From a worker's Stats: its owned ids and, in their order, each one's holders (a
        worker that sends no counts counts 1 for each)."""
        return cls(frozenset(owned), ref_counts=dict(zip(owned, ref_counts, strict=False)))


@dataclass(frozen=True)
class Discrepancy:
    kind: DiscrepancyKind
    worker_id: str
    block_ids: tuple[int, ...]  # sorted
    request_ids: tuple[str, ...] = ()  # the ledger holdings involved, sorted
    detail: str = ""


def _as_report(report: AllocatorReport | AbstractSet[int]) -> AllocatorReport:
    if isinstance(report, AllocatorReport):
        return report
    return AllocatorReport(owned=frozenset(report))


def find_discrepancies(
    holdings: Iterable[Holding],
    reports: Mapping[str, AllocatorReport | AbstractSet[int]],
    registered_workers: AbstractSet[str],
) -> list[Discrepancy]:
    """Discrepancies between ledger ``holdings`` and ``reports`` (worker id -> allocator
    report, or just its set of owned block ids). Workers without a report are compared
    only for liveness: their holdings are flagged if the worker is not registered."""
    found: list[Discrepancy] = []
    # worker -> block id -> requests holding it (pools merged: one id, one block table)
    held: dict[str, dict[int, set[str]]] = defaultdict(lambda: defaultdict(set))
    for h in holdings:
        ids = frozenset().union(*h.blocks.values())
        if not h.is_request_live:
            state = h.request_state or "expired"
            found.append(
                Discrepancy(
                    DiscrepancyKind.ENDED_REQUEST,
                    h.worker_id,
                    tuple(sorted(ids)),
                    (h.request_id,),
                    f"request {h.request_id} is {state}; its blocks are still held",
                )
            )
        if h.worker_id not in reports and h.worker_id not in registered_workers:
            found.append(
                Discrepancy(
                    DiscrepancyKind.DEAD_WORKER,
                    h.worker_id,
                    tuple(sorted(ids)),
                    (h.request_id,),
                    f"worker {h.worker_id} (epoch {h.epoch}) is not registered",
                )
            )
        for b in ids:
            held[h.worker_id][b].add(h.request_id)

    for worker_id, by_block in sorted(held.items()):
        raw = reports.get(worker_id)
        counts = _as_report(raw).ref_counts if raw is not None else {}
        for b, request_ids in sorted(by_block.items()):
            if len(request_ids) > counts.get(b, 1):  # shared prefixes count more
                found.append(
                    Discrepancy(
                        DiscrepancyKind.DOUBLE_HELD,
                        worker_id,
                        (b,),
                        tuple(sorted(request_ids)),
                        f"block {b} held by {len(request_ids)} requests; "
                        f"its worker counts {counts.get(b, 1)}",
                    )
                )

    for worker_id, raw in sorted(reports.items()):
        report = _as_report(raw)
        by_block = held.get(worker_id, {})
        ledger_ids = set(by_block)
        checks = (
            (DiscrepancyKind.LEDGER_ONLY, ledger_ids - report.owned - report.cached, "not owned"),
            (DiscrepancyKind.CACHED_BUT_HELD, ledger_ids & report.cached, "free (cached)"),
        )
        for kind, block_ids, what in checks:
            if block_ids:
                requests = sorted({r for b in block_ids for r in by_block[b]})
                detail = f"ledger: held by {', '.join(requests)}; worker: {what}"
                found.append(
                    Discrepancy(kind, worker_id, tuple(sorted(block_ids)), tuple(requests), detail)
                )
        orphans = report.owned - ledger_ids
        if orphans:
            detail = "worker: owned; ledger: no holding (unclaimed, or reclaimed after its lease)"
            found.append(
                Discrepancy(
                    DiscrepancyKind.WORKER_ONLY, worker_id, tuple(sorted(orphans)), (), detail
                )
            )
    return found


def seen_in_every_look(looks: Sequence[Sequence[Discrepancy]]) -> list[Discrepancy]:
    """The last look's discrepancies, each cut to the blocks that every look found in the
    same kind of discrepancy on the same worker (one without blocks: its requests). What
    only some looks saw was a block being granted or freed meanwhile, not a leak."""

    def marks(d: Discrepancy) -> set[Hashable]:
        if d.block_ids:
            return {(d.kind, d.worker_id, b) for b in d.block_ids}
        return {(d.kind, d.worker_id, d.request_ids)}

    if not looks:
        return []
    common = set.intersection(*({m for d in found for m in marks(d)} for found in looks))
    kept = []
    for d in looks[-1]:
        if not d.block_ids:
            if marks(d) <= common:
                kept.append(d)
            continue
        block_ids = tuple(b for b in d.block_ids if (d.kind, d.worker_id, b) in common)
        if block_ids:
            kept.append(replace(d, block_ids=block_ids))
    return kept

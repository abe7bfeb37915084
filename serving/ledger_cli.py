"""`tandem ledger audit`: check the ledger against the workers' allocators."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ledger.redis_connect import add_redis_arguments
from serving.auth import add_cluster_secret_argument

if TYPE_CHECKING:
    from ledger.audit import AllocatorReport
    from ledger.ledger import WorkerInfo


AUDIT_LOOK_INTERVAL_S = 0.2  # far longer than a worker takes to record a change


def register_ledger(subparsers: Any) -> None:
    """Add `tandem ledger audit`."""
    parser = subparsers.add_parser("ledger", help="inspect the cluster's Redis ledger")
    commands = parser.add_subparsers(dest="ledger_command", required=True)
    audit = commands.add_parser(
        "audit",
        help="compare the ledger's block holdings with every worker's allocator",
        description="Ask every registered worker for the block ids its allocator holds "
        "(Stats RPC) and compare them with the ledger's holdings. Exit 0 when they agree, "
        "1 on any discrepancy or unreachable worker. Repairs nothing. A live cluster is "
        "looked at again before a discrepancy counts (see --looks).",
    )
    add_redis_arguments(audit, required=True)
    add_cluster_secret_argument(audit)
    audit.add_argument("--namespace", default="td", help="ledger key namespace")
    audit.add_argument("--timeout-s", type=float, default=5.0, help="deadline of each Stats RPC")
    audit.add_argument(
        "--looks",
        type=int,
        default=3,
        help=f"a discrepancy counts once found in this many looks, {AUDIT_LOOK_INTERVAL_S} s "
        "apart (a block granted or freed while the audit looked is not one); a clean look "
        "ends the audit",
    )
    audit.add_argument("--json", action="store_true", help="print one JSON object")
    audit.set_defaults(func=_ledger_audit)


def _ledger_audit(args: argparse.Namespace) -> int:
    import asyncio
    import json
    import time

    import redis

    from ledger.audit import AllocatorReport, Discrepancy, seen_in_every_look
    from ledger.ledger import Ledger, WorkerRole
    from ledger.redis_connect import RedisConnectError, RedisSettings, connect, explain
    from serving.auth import AuthConfigError, cluster_metadata, cluster_secret_from_args

    if args.looks < 1:
        print(f"tandem ledger audit: error: --looks: at least 1, got {args.looks}", file=sys.stderr)
        return 1
    try:
        metadata = cluster_metadata(cluster_secret_from_args(args))
        settings = RedisSettings.from_args(args)
        client = connect(settings, decode_responses=True)
    except (RedisConnectError, AuthConfigError) as e:
        print(f"tandem ledger audit: error: {e}", file=sys.stderr)
        return 1
    try:
        ledger = Ledger(client, namespace=args.namespace)
        looks: list[list[Discrepancy]] = []
        while True:
            workers = [w for w in ledger.list_workers() if w.role is not WorkerRole.ROUTER]
            reports, unreachable = asyncio.run(
                _allocator_reports(workers, args.timeout_s, metadata)
            )
            looks.append(ledger.audit(reports))
            discrepancies = seen_in_every_look(looks)
            if not discrepancies or len(looks) == args.looks:
                break
            time.sleep(AUDIT_LOOK_INTERVAL_S)
    except redis.RedisError as e:
        print(f"tandem ledger audit: error: {explain(e, settings)}", file=sys.stderr)
        return 1
    finally:
        client.close()
    if args.json:
        print(
            json.dumps(
                {
                    "num_workers": len(workers),
                    "num_looks": len(looks),
                    "unreachable": unreachable,
                    "discrepancies": [
                        {
                            "kind": str(d.kind),
                            "worker_id": d.worker_id,
                            "block_ids": list(d.block_ids),
                            "request_ids": list(d.request_ids),
                            "detail": d.detail,
                        }
                        for d in discrepancies
                    ],
                },
                indent=2,
            )
        )
    else:
        if discrepancies:
            rows = [("KIND", "WORKER", "BLOCKS", "REQUESTS", "DETAIL")]
            rows += [
                (str(d.kind), d.worker_id, _ranges(d.block_ids), ",".join(d.request_ids), d.detail)
                for d in discrepancies
            ]
            widths = [max(len(row[i]) for row in rows) for i in range(4)]
            for row in rows:
                cells = (cell.ljust(w) for cell, w in zip(row[:4], widths, strict=True))
                print("  ".join((*cells, row[4])))
        for worker_id, error in unreachable.items():
            print(f"unreachable: {worker_id}: {error}")
        audited = sum(isinstance(r, AllocatorReport) for r in reports.values())
        print(f"{len(discrepancies)} discrepancies, {audited} of {len(workers)} workers audited")
    return 0 if not discrepancies and not unreachable else 1


async def _allocator_reports(
    workers: Sequence[WorkerInfo], timeout_s: float, metadata: Sequence[tuple[str, str]] = ()
) -> tuple[dict[str, AllocatorReport], dict[str, str]]:
    """Each worker's owned block ids through its Stats RPC; failures by worker id."""
    import asyncio

    import grpc  # type: ignore[import-untyped]

    from ledger.audit import AllocatorReport
    from ledger.ledger import WorkerRole
    from tandem.v1 import worker_pb2 as pb
    from tandem.v1 import worker_pb2_grpc as pb_grpc

    async def one(info: WorkerInfo) -> AllocatorReport:
        async with grpc.aio.insecure_channel(info.address) as channel:
            stub: Any
            if info.role is WorkerRole.PREFILL:
                stub = pb_grpc.PrefillWorkerStub(channel)
            else:
                stub = pb_grpc.DecodeWorkerStub(channel)
            request = pb.StatsRequest(include_block_ids=True)
            reply = await stub.Stats(request, timeout=timeout_s, metadata=metadata)
            return AllocatorReport.counted(reply.owned_block_ids, reply.owned_block_ref_counts)

    results = await asyncio.gather(*(one(w) for w in workers), return_exceptions=True)
    reports: dict[str, AllocatorReport] = {}
    unreachable: dict[str, str] = {}
    for info, result in zip(workers, results, strict=True):
        if isinstance(result, AllocatorReport):
            reports[info.worker_id] = result
        elif isinstance(result, grpc.aio.AioRpcError):
            unreachable[info.worker_id] = f"{result.code().name}: {result.details()}"
        else:
            unreachable[info.worker_id] = repr(result)
    return reports, unreachable


def _ranges(block_ids: Sequence[int]) -> str:
    """``1-3,7`` for sorted ids [1, 2, 3, 7]."""
    runs: list[list[int]] = []
    for b in block_ids:
        if runs and b == runs[-1][1] + 1:
            runs[-1][1] = b
        else:
            runs.append([b, b])
    return ",".join(str(a) if a == z else f"{a}-{z}" for a, z in runs)

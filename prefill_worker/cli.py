"""`tandem prefill` / `python -m prefill_worker`: one prefill worker process."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence
from typing import Any

DEFAULT_PORT = 50051
SERVICE_NAMES = ("tandem.v1.PrefillWorker",)
MAX_MESSAGE_BYTES = 16 << 20
log = logging.getLogger("prefill_worker")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from serving.engine_setup import add_engine_arguments
    from serving.rpc import add_kv_transport_argument, add_service_arguments

    add_engine_arguments(parser)
    add_service_arguments(parser, default_port=DEFAULT_PORT)
    parser.add_argument(
        "--max-queued", type=int, default=256, help="prefills in flight before RESOURCE_EXHAUSTED"
    )
    add_kv_transport_argument(parser)


def register_prefill(subparsers: Any) -> None:
    """Add `tandem prefill`."""
    parser = subparsers.add_parser(
        "prefill",
        help="run one prefill worker",
        description="Serve tandem.v1.PrefillWorker: prefill prompts (target and draft) and push "
        "their KV to the decode workers the router names.",
    )
    add_arguments(parser)
    parser.set_defaults(func=run)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m prefill_worker")
    add_arguments(parser)
    return run(parser.parse_args(argv))


def run(args: argparse.Namespace) -> int:
    from serving.rpc import run_service

    return run_service("prefill", serve, args)


async def serve(args: argparse.Namespace) -> None:
    from ledger.ledger import Ledger, WorkerRole
    from ledger.membership import Membership, Timing
    from ledger.redis_connect import RedisSettings, connect
    from prefill_worker.service import PrefillWorkerService
    from serving import engine_setup
    from serving.metrics import PrefillMetrics
    from serving.rpc import (
        advertised_address,
        default_worker_id,
        new_server,
        set_serving,
        wait_for_shutdown,
    )
    from tandem.v1 import worker_pb2_grpc

    spec = engine_setup.ModelSpec.from_args(args)
    engine = engine_setup.build_engine(spec, args)
    draft = engine_setup.draft_config(engine, spec)
    layout = engine_setup.kv_layout(engine, spec.served_name, draft.fingerprint if draft else "")

    server, health = new_server(MAX_MESSAGE_BYTES, SERVICE_NAMES if args.reflection else ())
    port = server.add_insecure_port(f"{args.host}:{args.port}")
    address = advertised_address(args, port)
    metrics = PrefillMetrics()
    metrics.serve(args.host, args.metrics_port)
    metrics.watch_loop()
    client = metrics.instrument_redis(connect(RedisSettings.from_args(args)))
    ledger = Ledger(client, namespace=args.namespace)
    holder: dict[str, PrefillWorkerService] = {}
    membership = Membership(
        ledger,
        args.worker_id or default_worker_id("prefill", address),
        role=WorkerRole.PREFILL,
        address=address,
        capacity=engine.block_manager.num_blocks,
        timing=Timing(args.heartbeat_ms, args.lease_ms),
        load=lambda: holder["service"].load() if holder else (0.0, {}),
    )
    service = holder["service"] = PrefillWorkerService(
        engine,
        served_name=spec.served_name,
        layout=layout,
        draft=draft,
        membership=membership,
        max_queued=args.max_queued,
        use_shm=args.kv_transport == "auto",
        metrics=metrics,
    )
    membership.register()
    worker_pb2_grpc.add_PrefillWorkerServicer_to_server(service, server)
    service.engine_loop.start()
    await server.start()
    membership.start()
    await set_serving(health, SERVICE_NAMES)
    log.info("prefill worker %s serving %s at %s", membership.worker_id, spec.served_name, address)
    reason = await wait_for_shutdown(args.parent_pid)
    log.info("draining (%s)", reason)
    await health.enter_graceful_shutdown()
    await service.drain(args.grace_s)
    await server.stop(1.0)
    await membership.stop()
    service.engine_loop.stop()
    await service.close()
    metrics.close()
    log.info("stopped")

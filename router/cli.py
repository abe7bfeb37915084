"""`tandem router` / `python -m router`: the gRPC front door of a Tandem cluster."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
from collections.abc import Sequence
from typing import Any

DEFAULT_PORT = 50050
SERVICE_NAMES = ("tandem.v1.Generation",)
log = logging.getLogger("router")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from serving.rpc import add_service_arguments

    group = parser.add_argument_group("model")
    group.add_argument("--model", required=True, help="HF model directory (or a prepared name)")
    group.add_argument("--served-model-name", help="name clients use (default: the directory's)")
    group.add_argument("--max-model-len", type=int, help="context length (default: the model's)")
    group.add_argument("--draft", metavar="DIR", help="the workers' draft (shown by ListModels)")
    group.add_argument("--threads", type=int, help="threads of the tokenizer's pool")
    add_service_arguments(parser, default_port=DEFAULT_PORT)
    parser.add_argument(
        "--request-timeout-s", type=float, default=600.0, help="deadline of calls without one"
    )
    parser.add_argument(
        "--max-request-bytes", type=int, default=1 << 20, help="larger requests are refused"
    )


def register_router(subparsers: Any) -> None:
    """Add `tandem router`."""
    parser = subparsers.add_parser(
        "router",
        help="run the router (tandem.v1.Generation)",
        description="Serve tandem.v1.Generation: validate and tokenize requests, route them to "
        "the prefill and decode workers registered in the ledger, stream the tokens back.",
    )
    add_arguments(parser)
    parser.set_defaults(func=run)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m router")
    add_arguments(parser)
    return run(parser.parse_args(argv))


def run(args: argparse.Namespace) -> int:
    from serving.rpc import run_service

    if args.threads:
        os.environ.setdefault("RAYON_NUM_THREADS", str(args.threads))
    return run_service("router", serve, args)


async def serve(args: argparse.Namespace) -> None:
    from pathlib import Path

    from engine.model_store import resolve_model
    from ledger.ledger import Ledger, WorkerRole
    from ledger.membership import Membership, Timing
    from ledger.redis_connect import RedisSettings, connect
    from router.routing import WorkerPicker
    from router.service import GenerationService
    from router.validation import ModelInfo, RequestValidator
    from serving.engine_setup import load_tokenizer
    from serving.metrics import RouterMetrics
    from serving.rpc import (
        advertised_address,
        default_worker_id,
        new_server,
        set_serving,
        wait_for_shutdown,
    )
    from tandem.v1 import generation_pb2_grpc

    model_dir = Path(resolve_model(args.model))
    name = args.served_model_name or model_dir.name
    model = ModelInfo.from_dir(model_dir, name, args.max_model_len)
    validator = RequestValidator(
        model, load_tokenizer(model_dir), max_request_bytes=args.max_request_bytes
    )
    server, health = new_server(
        4 * args.max_request_bytes, SERVICE_NAMES if args.reflection else ()
    )
    port = server.add_insecure_port(f"{args.host}:{args.port}")
    address = advertised_address(args, port)
    metrics = RouterMetrics()
    metrics.serve(args.host, args.metrics_port)
    metrics.watch_loop()
    client = metrics.instrument_redis(connect(RedisSettings.from_args(args)))
    ledger = Ledger(client, namespace=args.namespace)
    holder: dict[str, GenerationService] = {}
    membership = Membership(
        ledger,
        args.worker_id or default_worker_id("router", address),
        role=WorkerRole.ROUTER,
        address=address,
        capacity=0,
        timing=Timing(args.heartbeat_ms, args.lease_ms),
        load=lambda: holder["service"].load() if holder else (0.0, {}),
    )
    service = holder["service"] = GenerationService(
        validator=validator,
        picker=WorkerPicker(ledger, name),
        membership=membership,
        draft_dir_name=Path(args.draft).name if args.draft else "",
        default_timeout_s=args.request_timeout_s,
        metrics=metrics,
    )
    membership.register()
    generation_pb2_grpc.add_GenerationServicer_to_server(service, server)
    await server.start()
    membership.start()
    reaper = asyncio.create_task(service.reap_expired_leases(args.lease_ms / 1000))
    await set_serving(health, SERVICE_NAMES)
    log.info("router %s serving %s at %s", membership.worker_id, name, address)
    reason = await wait_for_shutdown(args.parent_pid)
    log.info("draining (%s)", reason)
    await health.enter_graceful_shutdown()
    await service.drain(args.grace_s)
    await server.stop(1.0)
    reaper.cancel()
    await membership.stop()
    await service.close()
    metrics.close()
    log.info("stopped")

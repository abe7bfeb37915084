"""`tandem decode` / `python -m decode_worker`: one decode worker process."""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import Sequence
from typing import Any

DEFAULT_PORT = 50061
SERVICE_NAMES = ("tandem.v1.DecodeWorker", "tandem.v1.KvTransfer")
log = logging.getLogger("decode_worker")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from serving.engine_setup import add_engine_arguments
    from serving.rpc import add_kv_transport_argument, add_service_arguments

    add_engine_arguments(parser)
    add_service_arguments(parser, default_port=DEFAULT_PORT)
    parser.add_argument(
        "--reserve-timeout-s", type=float, default=60.0, help="reservations lapse after this"
    )
    add_kv_transport_argument(parser)


def register_decode(subparsers: Any) -> None:
    """Add `tandem decode`."""
    parser = subparsers.add_parser(
        "decode",
        help="run one decode worker",
        description="Serve tandem.v1.DecodeWorker and tandem.v1.KvTransfer: reserve KV blocks, "
        "receive prefilled KV and decode (with the draft, if given).",
    )
    add_arguments(parser)
    parser.set_defaults(func=run)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m decode_worker")
    add_arguments(parser)
    return run(parser.parse_args(argv))


def run(args: argparse.Namespace) -> int:
    from serving.rpc import run_service

    return run_service("decode", serve, args)


async def serve(args: argparse.Namespace) -> None:
    from decode_worker.service import DecodeWorkerService
    from kv_transfer import KvReceiver, ShmAttacher, add_kv_transfer_servicer
    from kv_transfer import server_options as kv_server_options
    from ledger.ledger import Ledger, WorkerRole
    from ledger.membership import Membership, Timing
    from ledger.redis_connect import RedisSettings, connect
    from serving import engine_setup
    from serving.metrics import DecodeMetrics
    from serving.rpc import (
        advertised_address,
        default_worker_id,
        new_server,
        set_serving,
        wait_for_shutdown,
    )
    from tandem.v1 import worker_pb2_grpc

    spec = engine_setup.ModelSpec.from_args(args)
    engine = engine_setup.build_engine(spec, args, preemption="hand_back")
    draft = engine_setup.draft_config(engine, spec)
    layout = engine_setup.kv_layout(engine, spec.served_name, draft.fingerprint if draft else "")

    max_message_bytes = dict(kv_server_options())["grpc.max_receive_message_length"]
    server, health = new_server(max_message_bytes, SERVICE_NAMES if args.reflection else ())
    port = server.add_insecure_port(f"{args.host}:{args.port}")
    address = advertised_address(args, port)
    metrics = DecodeMetrics()
    metrics.serve(args.host, args.metrics_port)
    metrics.watch_loop()
    client = metrics.instrument_redis(connect(RedisSettings.from_args(args)))
    ledger = Ledger(client, namespace=args.namespace)

    holder: dict[str, DecodeWorkerService] = {}

    def registered_again(new_epoch: int) -> None:  # Redis lost data (restart, restore), a stall
        receiver.epoch = new_epoch  # pushes into reservations from now on carry it

    membership = Membership(
        ledger,
        args.worker_id or default_worker_id("decode", address),
        role=WorkerRole.DECODE,
        address=address,
        capacity=engine.block_manager.num_blocks,
        timing=Timing(args.heartbeat_ms, args.lease_ms),
        load=lambda: holder["service"].load() if holder else (0.0, {}),
        on_lease_lost=lambda rid: holder["service"].on_lease_lost(rid),
        on_registered_again=registered_again,
        rebuild_from=lambda: holder["service"].held_requests(),
    )
    epoch = membership.register()
    use_shm = args.kv_transport == "auto"
    receiver = KvReceiver(epoch=epoch, attach_segment=ShmAttacher() if use_shm else None)
    service = holder["service"] = DecodeWorkerService(
        engine,
        served_name=spec.served_name,
        layout=layout,
        draft=draft,
        receiver=receiver,
        membership=membership,
        reserve_timeout_s=args.reserve_timeout_s,
        accepts_shm=use_shm,
        metrics=metrics,
    )
    worker_pb2_grpc.add_DecodeWorkerServicer_to_server(service, server)
    add_kv_transfer_servicer(server, receiver)
    service.engine_loop.start()
    await server.start()
    membership.start()
    expiry = asyncio.create_task(service.expire_reservations())
    await set_serving(health, SERVICE_NAMES)
    log.info("decode worker %s serving %s at %s", membership.worker_id, spec.served_name, address)
    reason = await wait_for_shutdown(args.parent_pid)
    log.info("draining (%s)", reason)
    await health.enter_graceful_shutdown()
    await service.drain(args.grace_s)
    await server.stop(1.0)
    expiry.cancel()
    await membership.stop()
    service.engine_loop.stop()
    metrics.close()
    log.info("stopped")

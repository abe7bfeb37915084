"""`tandem colocated` / `python -m colocated_worker`: one co-located worker process."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from colocated_worker.service import ColocatedWorkerService
    from serving.component import Role, Runtime

DEFAULT_PORT = 50071
SERVICE_NAMES = ("tandem.v1.DecodeWorker", "tandem.v1.KvTransfer", "tandem.v1.PrefillWorker")


def role() -> Role:
    """The co-located worker's part in serving.component: a decode worker in the registry
    (imported late: `tandem --help`)."""
    from decode_worker.cli import role as decode_role
    from serving.component import Role
    from serving.metrics import ColocatedMetrics

    decode = decode_role()
    return Role(
        name="colocated",
        title="co-located worker",
        logger="colocated_worker",
        worker_role=decode.worker_role,
        service_names=SERVICE_NAMES,
        make_metrics=ColocatedMetrics,
        is_alive=decode.is_alive,
        max_message_bytes=decode.max_message_bytes,
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from decode_worker.cli import add_arguments as add_decode_arguments

    add_decode_arguments(parser, default_port=DEFAULT_PORT)
    parser.add_argument(
        "--max-queued", type=int, default=256, help="prefills in flight before RESOURCE_EXHAUSTED"
    )


def register_colocated(subparsers: Any) -> None:
    """Add `tandem colocated`."""
    parser = subparsers.add_parser(
        "colocated",
        help="run one co-located worker (prefill and decode in one process)",
        description="Serve tandem.v1.PrefillWorker and tandem.v1.DecodeWorker over one engine: "
        "the router sends it requests as to a prefill and decode worker pair, and the "
        "prompt's KV is computed straight into the blocks reserved for decoding (no KV "
        "transfer). `tandem serve --colocate` starts such workers and no prefill workers.",
    )
    add_arguments(parser)
    parser.set_defaults(func=run)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m colocated_worker")
    add_arguments(parser)
    return run(parser.parse_args(argv))


def run(args: argparse.Namespace) -> int:
    from serving.component import run_component
    from serving.engine_setup import check_engine_arguments

    if not check_engine_arguments(args, "co-located worker"):
        return 2
    return run_component(role(), args, make_service)


def make_service(runtime: Runtime) -> ColocatedWorkerService:
    """The decode side (engine, receiver, membership), then the prefill side over them."""
    from colocated_worker.service import ColocatedWorkerService
    from decode_worker.cli import make_service as make_decode_service
    from kv_transfer import InPlaceChannel
    from prefill_worker.in_place import InPlacePrefillService

    decode = make_decode_service(runtime, is_colocated=True)
    prefill = InPlacePrefillService(
        decode.engine,
        decode.engine_loop,
        served_name=decode.served_name,
        layout=decode.layout,
        draft=decode.draft,
        membership=decode.membership,
        channel=InPlaceChannel(decode.receiver),
        max_queued=runtime.args.max_queued,
        metrics=runtime.metrics,
    )
    return ColocatedWorkerService(decode, prefill)

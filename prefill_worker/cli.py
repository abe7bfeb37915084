"""`tandem prefill` / `python -m prefill_worker`: one prefill worker process."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from prefill_worker.service import PrefillWorkerService
    from serving.component import Role, Runtime

DEFAULT_PORT = 50051
SERVICE_NAMES = ("tandem.v1.PrefillWorker",)
MAX_MESSAGE_BYTES = 16 << 20


def role() -> Role:
    """The prefill worker's part in serving.component (imported late: `tandem --help`)."""
    from ledger.ledger import WorkerRole
    from serving.component import Role
    from serving.metrics import PrefillMetrics

    return Role(
        name="prefill",
        title="prefill worker",
        logger="prefill_worker",
        worker_role=WorkerRole.PREFILL,
        service_names=SERVICE_NAMES,
        make_metrics=PrefillMetrics,
        is_alive=lambda service, args: service.engine_loop.is_alive(args.engine_stall_s),
        max_message_bytes=lambda args: MAX_MESSAGE_BYTES,
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from serving.engine_setup import add_engine_arguments
    from serving.liveness import add_engine_stall_argument
    from serving.rpc import add_kv_transport_argument, add_service_arguments

    add_engine_arguments(parser)
    add_service_arguments(parser, default_port=DEFAULT_PORT)
    parser.add_argument(
        "--max-queued", type=int, default=256, help="prefills in flight before RESOURCE_EXHAUSTED"
    )
    add_kv_transport_argument(parser)
    add_engine_stall_argument(parser)


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
    from serving.component import run_component
    from serving.engine_setup import check_engine_arguments

    if not check_engine_arguments(args, "prefill worker"):
        return 2
    return run_component(role(), args, make_service)


def make_service(runtime: Runtime) -> PrefillWorkerService:
    """The engine (prefill only) and its service."""
    from kv_transfer import TransferOptions
    from prefill_worker.service import PrefillWorkerService
    from serving import engine_setup
    from serving.engine_loop import TorchThread, confine_torch

    args = runtime.args
    spec = engine_setup.ModelSpec.from_args(args)
    thread = TorchThread("prefill-engine")  # builds the engine, then steps it
    engine = thread.call(engine_setup.build_engine, spec, args, is_decoding=False)
    confine_torch()
    draft = engine_setup.draft_config(engine, spec)
    layout = engine_setup.kv_layout(engine, spec.served_name, draft.fingerprint if draft else "")
    return PrefillWorkerService(
        engine,
        torch_thread=thread,
        served_name=spec.served_name,
        layout=layout,
        draft=draft,
        membership=runtime.new_membership(capacity=engine.block_manager.total_blocks),
        max_queued=args.max_queued,
        transfer_options=TransferOptions(stall_s=args.transfer_stall_s),
        use_shm=args.kv_transport == "auto",
        metrics=runtime.metrics,
        channels=runtime.channel_pool(),
    )

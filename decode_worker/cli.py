"""`tandem decode` / `python -m decode_worker`: one decode worker process."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from decode_worker.service import DecodeWorkerService
    from serving.component import Role, Runtime

DEFAULT_PORT = 50061
SERVICE_NAMES = ("tandem.v1.DecodeWorker", "tandem.v1.KvTransfer")

log = logging.getLogger("decode_worker")


def role() -> Role:
    """The decode worker's part in serving.component (imported late: `tandem --help`)."""
    from ledger.ledger import WorkerRole
    from serving.component import Role
    from serving.metrics import DecodeMetrics

    return Role(
        name="decode",
        title="decode worker",
        logger="decode_worker",
        worker_role=WorkerRole.DECODE,
        service_names=SERVICE_NAMES,
        make_metrics=DecodeMetrics,
        is_alive=lambda service, args: service.engine_loop.is_alive(args.engine_stall_s),
        max_message_bytes=_max_message_bytes,
    )


def _max_message_bytes(args: argparse.Namespace) -> int:
    """A KV push's messages: as large as the KV transfer server takes."""
    from kv_transfer import server_options

    return int(dict(server_options())["grpc.max_receive_message_length"])


def add_arguments(parser: argparse.ArgumentParser, default_port: int = DEFAULT_PORT) -> None:
    from serving.engine_setup import add_engine_arguments
    from serving.liveness import add_engine_stall_argument
    from serving.rpc import add_kv_transport_argument, add_service_arguments

    add_engine_arguments(parser)
    add_service_arguments(parser, default_port=default_port)
    parser.add_argument(
        "--reserve-timeout-s", type=float, default=60.0, help="reservations lapse after this"
    )
    add_kv_transport_argument(parser)
    add_engine_stall_argument(parser)


def share_pools(engine: Any, layout: Any) -> Any:
    """The engine's KV pools moved into memory same-host senders write in place
    (``SharedKvPools.adopt``: a shared segment, or on a GPU an allocation exported through
    CUDA IPC), or None where they stay put. Captured CUDA graphs address the pools: they
    are released first and captured again over the pools where they then lie (on the
    engine's thread, which runs them). Where the runtime refuses to export the pools' GPU
    memory they stay put, their graphs untouched."""
    from kv_transfer import SharedKvPools

    graphs = getattr(engine.spec, "graphs", None)  # suffix decoding captures none
    pools = list(engine.kv_pools.values())  # a split worker's: rank 0's copy, no graph's
    if graphs is None or not graphs.graphs or not any(p in graphs.held for p in pools):
        return SharedKvPools.adopt(layout, engine.kv_pools)
    if (refusal := SharedKvPools.refusal(pools[0].layers[0][0].device)) is not None:
        log.warning("KV pools stay unshared (same-host pushes use the ring): %s", refusal)
        return None
    graphs.release()
    try:
        return SharedKvPools.adopt(layout, engine.kv_pools)
    finally:
        graphs.recapture()


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
    from serving.component import run_component
    from serving.engine_setup import check_engine_arguments

    if not check_engine_arguments(args, "decode worker"):
        return 2
    return run_component(role(), args, make_service)


def make_service(runtime: Runtime, *, is_colocated: bool = False) -> DecodeWorkerService:
    """The engine (which hands preempted requests back), the KV receiver and the
    service; ``is_colocated``: the decode side of a co-located worker (colocated_worker)."""
    from decode_worker.service import DecodeWorkerService
    from kv_transfer import KvReceiver, ShmAttacher
    from serving import engine_setup
    from serving.engine_loop import TorchThread, confine_torch

    args = runtime.args
    spec = engine_setup.ModelSpec.from_args(args)
    thread = TorchThread("decode-engine")  # builds the engine, then steps it
    engine = thread.call(
        engine_setup.build_engine, spec, args, is_decoding=True, preemption="hand_back"
    )
    confine_torch()
    draft = engine_setup.draft_config(engine, spec)
    layout = engine_setup.kv_layout(engine, spec.served_name, draft.fingerprint if draft else "")
    membership = runtime.new_membership(capacity=engine.block_manager.total_blocks)
    use_shm = args.kv_transport == "auto"
    shared = thread.call(share_pools, engine, layout) if use_shm else None  # written in place
    attach = ShmAttacher() if use_shm else None
    # Its epoch is the registration's, set on registering (DecodeWorkerService.on_registered).
    receiver = KvReceiver(attach_segment=attach, shared_pools=shared, stall_s=args.transfer_stall_s)
    return DecodeWorkerService(
        engine,
        torch_thread=thread,
        served_name=spec.served_name,
        layout=layout,
        draft=draft,
        receiver=receiver,
        membership=membership,
        reserve_timeout_s=args.reserve_timeout_s,
        accepts_shm=use_shm,
        metrics=runtime.metrics,
        is_colocated=is_colocated,
    )

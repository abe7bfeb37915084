"""`tandem router` / `python -m router`: the gRPC front door of a Tandem cluster."""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ledger.membership import HeldRequest
    from router.http_api.server import HttpServer
    from router.service import GenerationService
    from serving.component import Role, Runtime

log = logging.getLogger("router")

DEFAULT_PORT = 50050
DEFAULT_HTTP_PORT = 8000
SERVICE_NAMES = ("tandem.v1.Generation",)


def role() -> Role:
    """The router's part in serving.component (imported late: `tandem --help` stays light)."""
    from ledger.ledger import WorkerRole
    from serving.component import Role
    from serving.metrics import RouterMetrics

    return Role(
        name="router",
        title="router",
        logger="router",
        worker_role=WorkerRole.ROUTER,
        service_names=SERVICE_NAMES,
        make_metrics=RouterMetrics,
        max_message_bytes=lambda args: 4 * args.max_request_bytes,
        is_public=True,
        is_ready=lambda component: component.service.is_ready(),
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from serving.auth import add_auth_token_argument
    from serving.rpc import add_service_arguments

    group = parser.add_argument_group("model")
    group.add_argument(
        "--model",
        required=True,
        help="HF model directory, a prepared name, or a .gguf file whose model directory "
        "exists (`tandem models prepare FILE.gguf`)",
    )
    group.add_argument(
        "--served-model-name",
        help="name clients use (default: the directory's; a .gguf file's stem)",
    )
    group.add_argument(
        "--tokenizer",
        metavar="DIR",
        help="with --model FILE.gguf: the tokenizer directory the workers were given",
    )
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
    parser.add_argument(
        "--max-in-flight",
        type=int,
        default=1024,
        help="requests this router serves at once; more are refused with RESOURCE_EXHAUSTED "
        "(HTTP 429) and a retry hint (default: 1024)",
    )
    parser.add_argument(
        "--max-waiting",
        type=int,
        default=256,
        help="of those, requests that wait for KV room while every decode worker is full; more "
        "are refused the same way instead of waiting (default: 256)",
    )
    parser.add_argument(
        "--http-port",
        type=int,
        default=DEFAULT_HTTP_PORT,
        help="port of the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, "
        f"/v1/models, /health) on --host; 0: no HTTP (default: {DEFAULT_HTTP_PORT})",
    )
    parser.add_argument(
        "--allow-runtime-lora",
        action="store_true",
        help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (behind "
        "--auth-token-file's token): each live worker loads or unloads the adapter (they "
        "need --allow-runtime-lora too). Off by default: 404",
    )
    add_auth_token_argument(parser)


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
    from serving.component import run_component

    if args.threads:
        os.environ.setdefault("RAYON_NUM_THREADS", str(args.threads))
    return run_component(role(), args, make_service)


def make_service(runtime: Runtime) -> RouterComponent:
    """The Generation service over the model's tokenizer and the ledger's workers."""
    from router.models import resolve_model_dir, served_name
    from router.routing import WorkerPicker
    from router.service import GenerationService
    from router.tokenizer import load_tokenizer
    from router.validation import ModelInfo, RequestValidator

    args = runtime.args
    model_dir = resolve_model_dir(args.model, tokenizer=args.tokenizer)
    tokenizer = load_tokenizer(model_dir)
    name = args.served_model_name or served_name(model_dir)
    model = ModelInfo.from_dir(model_dir, name, args.max_model_len)
    picker = WorkerPicker(runtime.ledger, name)
    validator = RequestValidator(
        model, tokenizer, max_request_bytes=args.max_request_bytes, adapters=picker.lora_names
    )
    membership = runtime.new_membership(capacity=0)
    service = GenerationService(
        validator=validator,
        picker=picker,
        membership=membership,
        draft_dir_name=Path(args.draft).name if args.draft else "",
        default_timeout_s=args.request_timeout_s,
        metrics=runtime.metrics,
        channels=runtime.channel_pool(),
        max_in_flight=args.max_in_flight,
        max_waiting=args.max_waiting,
    )
    http = None
    if args.http_port:
        from router.http_api.app import make_app
        from router.http_api.server import HttpServer

        app = make_app(
            service, auth_token=runtime.auth_token, allow_runtime_lora=args.allow_runtime_lora
        )
        if args.allow_runtime_lora and runtime.auth_token is None:
            log.warning(
                "--allow-runtime-lora without --auth-token-file: whoever reaches the HTTP "
                "port can load adapters from any directory on the workers' hosts, and unload "
                "any adapter"
            )
        http = HttpServer(app, args.host, args.http_port)
    return RouterComponent(service, name, lease_s=args.lease_ms / 1000, http=http)


class RouterComponent:
    """The router as serving.component runs it: it holds no KV blocks, so the ledger
    losing data only re-registers it; its housekeeping reaps expired worker leases."""

    def __init__(
        self,
        service: GenerationService,
        served_name: str,
        *,
        lease_s: float,
        http: HttpServer | None = None,
    ) -> None:
        self.service = service
        self.served_name = served_name
        self.lease_s = lease_s
        self.http = http

    def load(self) -> tuple[float, dict[str, str | int | float]]:
        return self.service.load()

    def on_lease_lost(self, request_id: str) -> None:
        pass

    def on_registered(self, epoch: int) -> None:
        pass

    async def held_requests(self) -> Sequence[HeldRequest]:
        return ()

    def add_to(self, server: Any) -> None:
        from tandem.v1 import generation_pb2_grpc

        generation_pb2_grpc.add_GenerationServicer_to_server(self.service, server)

    def start(self) -> None:
        if self.http is not None:
            self.http.start()

    async def housekeeping(self) -> None:
        await self.service.reap_expired_leases(self.lease_s)

    async def drain(self, timeout_s: float) -> None:
        await self.service.drain(timeout_s)

    async def close(self) -> None:
        if self.http is not None:
            await self.http.stop()
        await self.service.close()

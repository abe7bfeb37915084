"""What every Tandem gRPC server shares: exceptions to status codes in one interceptor,
grpc.health.v1, bounded messages and keepalive, and a graceful drain on SIGTERM.

Servicers stay thin and raise plain exceptions; ``ErrorInterceptor`` turns them into
status codes: ValueError -> INVALID_ARGUMENT, a full cache or queue -> RESOURCE_EXHAUSTED,
LedgerConflict -> ABORTED, the ledger's Redis unreachable -> UNAVAILABLE, a downstream RPC
error -> its own code, anything else -> INTERNAL with a short message (the traceback goes
to the log). No request crashes a server.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import re
import signal
import socket
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterable, Sequence
from typing import Any

import grpc  # type: ignore[import-untyped]  # no types-grpcio in the dev extra
from grpc_health.v1 import health, health_pb2, health_pb2_grpc  # type: ignore[import-untyped]

from ledger.redis_connect import add_redis_arguments
from serving.auth import AuthConfigError, add_cluster_secret_argument, metadata_interceptors
from tandem_client.wire import DEFAULT_RETRY_AFTER_S, KV_PUSH_STATUS_KEY, RETRY_AFTER_MS_KEY

log = logging.getLogger(__name__)

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
MAX_STATUS_MESSAGE = 400  # characters of an exception message sent back


class Overloaded(Exception):
    """A bounded queue is full: RESOURCE_EXHAUSTED, with a hint of when to retry (trailing
    metadata RETRY_AFTER_MS_KEY); the client retries later or elsewhere."""

    def __init__(self, message: str, retry_after_s: float = DEFAULT_RETRY_AFTER_S) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s

    @property
    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return ((RETRY_AFTER_MS_KEY, str(max(1, round(self.retry_after_s * 1000)))),)


class PreconditionFailed(Exception):
    """A request that does not fit this server's state (epoch, draft): FAILED_PRECONDITION."""


class Unavailable(Exception):
    """Draining, or no worker to route to: UNAVAILABLE."""


class NotFound(Exception):
    """An unknown request or model: NOT_FOUND."""


class PermissionDenied(Exception):
    """A call this component was started not to take (an option turns it on):
    PERMISSION_DENIED."""


# (module, class name, status), the first match wins: subclasses before their bases.
# Classes are looked up in sys.modules: an exception of a module that was never imported
# cannot have been raised, so the router need not import torch to map engine errors.
_STATUS_BY_TYPE: Sequence[tuple[str, str, grpc.StatusCode]] = (
    ("engine.kv_cache", "KVCacheCapacityError", grpc.StatusCode.RESOURCE_EXHAUSTED),
    ("engine.lora.registry", "LoraMemoryFull", grpc.StatusCode.RESOURCE_EXHAUSTED),
    ("engine.lora.registry", "LoraInUse", grpc.StatusCode.FAILED_PRECONDITION),
    ("engine.lora.registry", "LoraMismatch", grpc.StatusCode.FAILED_PRECONDITION),
    ("engine.lora.registry", "LoraNotLoaded", grpc.StatusCode.NOT_FOUND),
    ("engine.outputs", "RequestFailed", grpc.StatusCode.INTERNAL),  # its message is shown
    (__name__, "Overloaded", grpc.StatusCode.RESOURCE_EXHAUSTED),
    (__name__, "PreconditionFailed", grpc.StatusCode.FAILED_PRECONDITION),
    (__name__, "Unavailable", grpc.StatusCode.UNAVAILABLE),
    (__name__, "NotFound", grpc.StatusCode.NOT_FOUND),
    (__name__, "PermissionDenied", grpc.StatusCode.PERMISSION_DENIED),
    ("ledger.ledger", "LedgerConflict", grpc.StatusCode.ABORTED),
    ("kv_transfer.base", "KvTransferError", grpc.StatusCode.UNAVAILABLE),
    ("builtins", "TimeoutError", grpc.StatusCode.DEADLINE_EXCEEDED),
    ("builtins", "ValueError", grpc.StatusCode.INVALID_ARGUMENT),
)


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and message a client gets for ``exc``."""
    if isinstance(exc, grpc.aio.AioRpcError):  # a downstream call: pass its status on
        return exc.code(), exc.details() or exc.code().name
    if _is_redis_unreachable(exc):
        return grpc.StatusCode.UNAVAILABLE, _short(
            f"the ledger's Redis is unreachable ({exc}); retry once it is back"
        )
    for module_name, class_name, code in _STATUS_BY_TYPE:
        module = sys.modules.get(module_name)
        cls = getattr(module, class_name, None) if module is not None else None
        if cls is not None and isinstance(exc, cls):
            return code, _short(str(exc) or class_name)
    return grpc.StatusCode.INTERNAL, f"internal error ({type(exc).__name__}); see the server log"


def trailing_metadata_of(exc: BaseException) -> tuple[tuple[str, str], ...]:
    """What travels with ``exc``'s status besides the message: a downstream call's own
    trailing metadata (passed on, as its status is), or what the exception carries
    (``KvTransferError.trailing_metadata``, ``Overloaded``'s retry hint). Every
    RESOURCE_EXHAUSTED carries a retry hint, the default one where none was given."""
    if isinstance(exc, grpc.aio.AioRpcError):
        found = tuple((k, v) for k, v in (exc.trailing_metadata() or ()) if isinstance(v, str))
    else:
        found = tuple(getattr(exc, "trailing_metadata", ()))
    if status_of(exc)[0] is grpc.StatusCode.RESOURCE_EXHAUSTED and retry_after_s(found) is None:
        found += Overloaded("", DEFAULT_RETRY_AFTER_S).trailing_metadata
    return found


def retry_after_s(metadata: Sequence[tuple[str, str]]) -> float | None:
    """The retry hint in trailing ``metadata``, in seconds, if there is one."""
    for key, value in metadata:
        if key == RETRY_AFTER_MS_KEY and value.isdigit():
            return int(value) / 1000
    return None


def kv_push_status(error: grpc.aio.AioRpcError) -> str | None:
    """The KvPushStatus name when ``error`` is a KV push that the receiver refused
    (``KV_PUSH_STATUS_STALE_EPOCH``, ...), else None."""
    for key, value in error.trailing_metadata() or ():
        if key == KV_PUSH_STATUS_KEY:
            return str(value)
    return None


def _is_redis_unreachable(exc: BaseException) -> bool:
    """A redis-py connection error or timeout (looked up in sys.modules, as in status_of)."""
    module = sys.modules.get("redis.exceptions")
    if module is None:
        return False
    return isinstance(exc, module.ConnectionError | module.TimeoutError)


def _short(message: str) -> str:
    return message if len(message) <= MAX_STATUS_MESSAGE else message[:MAX_STATUS_MESSAGE] + "..."


async def _abort(context: Any, exc: Exception, method: str) -> None:
    if isinstance(exc, grpc.aio.AbortError):  # context.abort was called: already a status
        raise exc
    code, message = status_of(exc)
    if code is grpc.StatusCode.INTERNAL:
        log.error("%s failed", method, exc_info=exc)
    else:
        log.debug("%s: %s %s", method, code.name, message)
    await context.abort(code, message, trailing_metadata=trailing_metadata_of(exc))


class Malformed:
    """A request message that did not parse (what ``_lenient`` hands the behavior)."""

    def __init__(self, method: str, error: Exception) -> None:
        self.message = (
            f"request: not a valid message for {method} ({type(error).__name__}); send the "
            "serialized request message of the method"
        )


def _lenient(deserializer: Callable[[bytes], Any] | None, method: str) -> Any:
    """``deserializer``, except that bytes it cannot parse become a ``Malformed``, which
    the behavior's wrapper answers INVALID_ARGUMENT (grpc would answer UNKNOWN and log a
    traceback per request)."""
    if deserializer is None:
        return None

    def parse(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception as e:  # DecodeError, or a generated class's own refusal
            return Malformed(method, e)

    return parse


def _checked(request: Any) -> Any:
    if isinstance(request, Malformed):
        raise ValueError(request.message)
    return request


async def _checked_stream(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
    async for request in requests:
        yield _checked(request)


def _wrap_unary(
    behavior: Callable[..., Awaitable[Any]], method: str, *, streams_requests: bool
) -> Callable[..., Any]:
    async def wrapper(request: Any, context: Any) -> Any:
        try:
            request = _checked_stream(request) if streams_requests else _checked(request)
            return await behavior(request, context)
        except Exception as e:
            await _abort(context, e, method)

    return wrapper


def _wrap_stream(
    behavior: Callable[..., AsyncIterator[Any]], method: str, *, streams_requests: bool
) -> Callable[..., Any]:
    async def wrapper(request: Any, context: Any) -> AsyncIterator[Any]:
        try:
            request = _checked_stream(request) if streams_requests else _checked(request)
            async for item in behavior(request, context):
                yield item
        except Exception as e:
            await _abort(context, e, method)

    return wrapper


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Maps the exceptions of every handler to status codes (see status_of), and a
    request that does not parse to INVALID_ARGUMENT."""

    async def intercept_service(self, continuation: Any, details: Any) -> Any:
        handler = await continuation(details)
        if handler is None:
            return None
        method = details.method
        kinds = (
            ("unary_unary", grpc.unary_unary_rpc_method_handler, _wrap_unary, False),
            ("stream_unary", grpc.stream_unary_rpc_method_handler, _wrap_unary, True),
            ("unary_stream", grpc.unary_stream_rpc_method_handler, _wrap_stream, False),
            ("stream_stream", grpc.stream_stream_rpc_method_handler, _wrap_stream, True),
        )
        for attribute, make, wrap, streams_requests in kinds:
            behavior = getattr(handler, attribute)
            if behavior is not None:
                return make(
                    wrap(behavior, method, streams_requests=streams_requests),
                    request_deserializer=_lenient(handler.request_deserializer, method),
                    response_serializer=handler.response_serializer,
                )
        return handler


DEFAULT_KEEPALIVE_MS = 20_000


def server_options(
    max_message_bytes: int, keepalive_ms: int = DEFAULT_KEEPALIVE_MS
) -> list[tuple[str, Any]]:
    """Bounded messages and keepalive for a Tandem server: it pings idle clients every
    ``keepalive_ms`` and lets clients ping it as often as every quarter of that (a Tandem
    peer pings every ``keepalive_ms``: ``channel_options``)."""
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", keepalive_ms),
        ("grpc.keepalive_timeout_ms", keepalive_ms // 2),
        ("grpc.http2.ping_timeout_ms", keepalive_ms // 2),  # else 60 s, whatever the above
        ("grpc.http2.min_ping_interval_without_data_ms", min(5_000, keepalive_ms // 4)),
        ("grpc.keepalive_permit_without_calls", 1),
    ]


def channel_options(
    max_message_bytes: int = 64 << 20, keepalive_ms: int = DEFAULT_KEEPALIVE_MS
) -> list[tuple[str, Any]]:
    """Bounded messages, keepalive, and reconnection at most 1 s apart: a worker restarted
    at the same address is reached within a second of listening (gRPC's default backoff
    grows to 2 minutes). A peer that answers no ping for ``keepalive_ms`` / 2 (stopped,
    frozen, cut off) fails its calls with UNAVAILABLE within 1.5 x ``keepalive_ms``: the
    router then resumes its requests elsewhere, as if it had died."""
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", keepalive_ms),
        ("grpc.keepalive_timeout_ms", keepalive_ms // 2),
        # A ping's ack is awaited this long (gRPC's own default is 60 s, which the keepalive
        # timeout does not shorten: measured, a SIGSTOPped peer was given up after 60 s).
        ("grpc.http2.ping_timeout_ms", keepalive_ms // 2),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.initial_reconnect_backoff_ms", 200),
        ("grpc.max_reconnect_backoff_ms", 1000),
    ]


class ChannelPool:
    """One grpc.aio channel per peer address, opened on first use, closed together.
    ``metadata`` goes with every call (the cluster secret: serving.auth)."""

    def __init__(
        self, metadata: Sequence[tuple[str, str]] = (), keepalive_ms: int = DEFAULT_KEEPALIVE_MS
    ) -> None:
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._interceptors = metadata_interceptors(metadata) or None
        self._options = channel_options(keepalive_ms=keepalive_ms)

    def get(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            channel = grpc.aio.insecure_channel(
                address, options=self._options, interceptors=self._interceptors
            )
            self._channels[address] = channel
        return channel

    def connect(self, addresses: Iterable[str]) -> None:
        """Starts connecting to ``addresses`` now, in the background, so that a request's
        first call to a peer does not wait for the connection (channels are lazy)."""
        for address in addresses:
            self.get(address).get_state(try_to_connect=True)

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()


def new_server(
    max_message_bytes: int,
    reflected_services: Sequence[str] = (),
    auth: Sequence[grpc.aio.ServerInterceptor] = (),
    keepalive_ms: int = DEFAULT_KEEPALIVE_MS,
) -> tuple[grpc.aio.Server, Any]:
    """A grpc.aio server with the error interceptor and a health servicer (returned);
    with ``reflected_services``, also gRPC server reflection for them (and health), so
    that grpcurl and grpcui can list and call them without the .proto files. ``auth``:
    interceptors that refuse unauthenticated calls (serving.auth), run first."""
    server = grpc.aio.server(
        interceptors=[*auth, ErrorInterceptor()],
        options=server_options(max_message_bytes, keepalive_ms),
    )
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if reflected_services:
        from grpc_reflection.v1alpha import reflection  # type: ignore[import-untyped]

        names = (*reflected_services, health.SERVICE_NAME, reflection.SERVICE_NAME)
        reflection.enable_server_reflection(names, server)
    return server, health_servicer


async def set_serving(
    health_servicer: Any, service_names: Sequence[str], *, is_overall: bool = True
) -> None:
    """SERVING for ``service_names``, and for the server as a whole (service "") unless
    ``is_overall`` is False."""
    names = ("", *service_names) if is_overall else tuple(service_names)
    for name in names:
        await health_servicer.set(name, SERVING)


async def wait_for_shutdown(parent_pid: int | None = None) -> str:
    """Returns on SIGTERM or SIGINT (the signal's name), or when ``parent_pid`` is gone
    (the launcher died: its children must not outlive it)."""
    loop = asyncio.get_running_loop()
    stop: asyncio.Future[str] = loop.create_future()

    def on_signal(name: str) -> None:
        if not stop.done():
            stop.set_result(name)

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig.name)
    try:
        while not stop.done():
            if parent_pid is not None and os.getppid() != parent_pid:
                return "parent exited"
            await asyncio.wait([stop], timeout=0.5)
        return stop.result()
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)


def setup_logging(component: str, level: str = "INFO") -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format=f"%(asctime)s {component} %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def add_service_arguments(parser: argparse.ArgumentParser, *, default_port: int) -> None:
    """Options every Tandem service process takes: where it listens and its ledger."""
    group = parser.add_argument_group("service")
    group.add_argument("--host", default="127.0.0.1", help="address to listen on")
    group.add_argument("--port", type=int, default=default_port, help="port (0: any free one)")
    group.add_argument(
        "--advertise-host", help="host others reach this service at (default: --host)"
    )
    add_redis_arguments(group, required=True)
    group.add_argument("--namespace", default="td", help="ledger key namespace")
    group.add_argument("--id", dest="worker_id", help="registry id (default: role-host-port)")
    group.add_argument("--heartbeat-ms", type=int, default=2000, help="heartbeat period")
    group.add_argument("--lease-ms", type=int, default=10_000, help="lease on held KV blocks")
    group.add_argument("--grace-s", type=float, default=30.0, help="drain time on SIGTERM")
    group.add_argument(
        "--keepalive-ms",
        type=int,
        default=DEFAULT_KEEPALIVE_MS,
        help="gRPC keepalive ping period, to and from peers; a peer that answers none for half "
        "of it (stopped, frozen, cut off) is given up on and its requests are resumed elsewhere "
        f"(default: {DEFAULT_KEEPALIVE_MS}; at least 1000)",
    )
    group.add_argument(
        "--metrics-port", type=int, default=0, help="serve Prometheus /metrics here (0: off)"
    )
    group.add_argument(
        "--metrics-host",
        default="127.0.0.1",
        help="address /metrics listens on, apart from --host (default: 127.0.0.1)",
    )
    add_cluster_secret_argument(group)
    group.add_argument(
        "--reflection",
        action="store_true",
        help="serve gRPC server reflection (for grpcurl / grpcui; off by default)",
    )
    group.add_argument("--log-level", default="INFO")
    group.add_argument("--parent-pid", type=int, help=argparse.SUPPRESS)  # exit with the launcher


def add_kv_transport_argument(parser: argparse.ArgumentParser) -> None:
    """``--kv-transport`` and ``--transfer-stall-s``, which both worker kinds take (the
    sender and the receiver)."""
    parser.add_argument(
        "--kv-transport",
        choices=["auto", "grpc"],
        default="auto",
        help="auto: KV between workers on one host goes through shared memory; grpc: always "
        "the gRPC stream",
    )
    parser.add_argument(
        "--transfer-stall-s",
        type=_positive_float,
        default=10.0,
        help="a KV push in which nothing moves for this long (no layer from the prefill "
        "engine, no chunk sent or received, no reply) is aborted as stalled: both sides free "
        "its blocks and the router prefills the request again elsewhere; a request queued "
        "behind others is not stalled while the engine computes theirs (default: 10)",
    )


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def run_service(
    role: str,
    serve: Callable[[argparse.Namespace], Coroutine[Any, Any, None]],
    args: argparse.Namespace,
) -> int:
    """A service process's body: logging, then ``serve(args)`` until shutdown. A Redis that
    cannot be reached or refuses the credentials, or a credential file that cannot be read,
    ends it with one logged line and exit 1."""
    from ledger.redis_connect import RedisConnectError

    setup_logging(role, args.log_level)
    try:
        asyncio.run(serve(args))
    except (RedisConnectError, AuthConfigError) as e:
        logging.getLogger(role).error("%s", e)
        return 1
    return 0


def advertised_address(args: argparse.Namespace, port: int) -> str:
    host = args.advertise_host or args.host
    if host in ("0.0.0.0", "::", ""):
        host = socket.gethostname()
    return f"{host}:{port}"


def default_worker_id(role: str, address: str) -> str:
    """``role-host-port`` in the ledger's id alphabet."""
    return re.sub(r"[^A-Za-z0-9._:-]", "-", f"{role}-{address}".replace(":", "-"))[:128]

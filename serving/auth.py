"""Opt-in authentication of Tandem's gRPC servers and their internal calls.

Two credentials, each read from a file (argv is public) or the environment (how the
launcher hands them to its children, as it does the Redis password):

- the router's bearer token (``--auth-token-file``): clients send ``authorization: Bearer
  TOKEN`` on tandem.v1.Generation calls (and on the HTTP API's /v1/*);
- the cluster secret (``--cluster-secret-file``, else ``$TANDEM_CLUSTER_SECRET``): the
  router and the prefill workers send it as ``tandem-cluster-secret`` on every call to a
  worker, so that only they can call PrefillWorker, DecodeWorker and KvTransfer.

Both are compared in constant time. grpc.health.v1 and reflection stay open. Without
either, nothing is checked and nothing is sent: a cluster behaves as before.
"""

from __future__ import annotations

import argparse
import hmac
import ipaddress
import os
import secrets
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc  # type: ignore[import-untyped]  # no types-grpcio in the dev extra

CLUSTER_SECRET_ENV = "TANDEM_CLUSTER_SECRET"
CLUSTER_SECRET_KEY = "tandem-cluster-secret"
AUTHORIZATION_KEY = "authorization"
BEARER = "Bearer "


class AuthConfigError(RuntimeError):
    """A credential file that cannot be read or is empty: the process does not start."""


def new_secret() -> str:
    """A random credential (256 bits, URL-safe: fits gRPC metadata and Redis config)."""
    return secrets.token_urlsafe(32)


def read_secret_file(path: str | Path, option: str) -> str:
    """The file's content without its trailing newline; ``option`` names it in errors."""
    try:
        value = Path(path).read_text().strip()  # HTTP strips a header value's blanks too
    except OSError as e:
        raise AuthConfigError(f"{option}: cannot read {path}: {e.strerror}") from None
    if not value or not value.isprintable() or not value.isascii():
        raise AuthConfigError(f"{option}: {path} must hold one line of printable ASCII")
    return value


def auth_token_from_args(args: argparse.Namespace) -> str | None:
    """The router's bearer token (``--auth-token-file``); None: clients are not checked."""
    path = getattr(args, "auth_token_file", None)
    return read_secret_file(path, "--auth-token-file") if path else None


def cluster_secret_from_args(
    args: argparse.Namespace, environ: Mapping[str, str] = os.environ
) -> str | None:
    """The cluster secret: ``--cluster-secret-file``, else ``$TANDEM_CLUSTER_SECRET``;
    None: internal calls are neither checked nor credentialed."""
    path = getattr(args, "cluster_secret_file", None)
    if path:
        return read_secret_file(path, "--cluster-secret-file")
    return environ.get(CLUSTER_SECRET_ENV) or None


def add_cluster_secret_argument(parser: Any) -> None:
    parser.add_argument(
        "--cluster-secret-file",
        metavar="PATH",
        help="the secret the router and workers share (one line); calls to worker RPCs "
        f"must carry it (default: ${CLUSTER_SECRET_ENV} if set; none: unchecked)",
    )


def add_auth_token_argument(parser: Any) -> None:
    parser.add_argument(
        "--auth-token-file",
        metavar="PATH",
        help="require 'authorization: Bearer TOKEN' (gRPC) and 'Authorization: Bearer TOKEN' "
        "(HTTP /v1/*) with the token this file holds (one line); default: no authentication",
    )


# ---- server side


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls to ``services`` whose metadata ``key`` is not ``expected`` with
    UNAUTHENTICATED and ``hint``; other services (health, reflection) pass."""

    def __init__(self, services: Collection[str], key: str, expected: str, hint: str) -> None:
        self.services = frozenset(services)
        self.key = key
        self.expected = expected.encode()
        self.hint = hint

    def is_allowed(self, metadata: Sequence[Any] | None) -> bool:
        sent = b""
        for item in metadata or ():
            key, value = item[0], item[1]
            if key == self.key:
                sent = value if isinstance(value, bytes) else str(value).encode()
                break
        return hmac.compare_digest(sent, self.expected)

    async def intercept_service(self, continuation: Any, details: Any) -> Any:
        service = details.method.split("/")[1] if details.method.count("/") == 2 else ""
        if service not in self.services:
            return await continuation(details)
        handler = await continuation(details)
        if handler is None or self.is_allowed(details.invocation_metadata):
            return handler
        return _refusing(handler, f"{details.method}: {self.hint}")


def _refusing(handler: Any, message: str) -> Any:
    """A handler of ``handler``'s kind that answers UNAUTHENTICATED without reading the
    request."""

    async def refuse(request: Any, context: Any) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def refuse_stream(request: Any, context: Any) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover  # abort raises: a generator for streaming replies only

    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(refuse)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(refuse)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(refuse_stream)
    return grpc.stream_stream_rpc_method_handler(refuse_stream)


def bearer_interceptor(services: Collection[str], token: str) -> AuthInterceptor:
    return AuthInterceptor(
        services,
        AUTHORIZATION_KEY,
        BEARER + token,
        "send the router's token as metadata 'authorization: Bearer TOKEN' (the SDK's "
        "token=, the CLI's --token)",
    )


def cluster_interceptor(services: Collection[str], secret: str) -> AuthInterceptor:
    return AuthInterceptor(
        services,
        CLUSTER_SECRET_KEY,
        secret,
        f"internal RPC: only the cluster's router and workers may call it (metadata "
        f"'{CLUSTER_SECRET_KEY}', the cluster secret)",
    )


# ---- client side


def _with_metadata(details: Any, extra: Sequence[tuple[str, str]]) -> Any:
    metadata = grpc.aio.Metadata(*(details.metadata or ()), *extra)
    return details._replace(metadata=metadata)


class _AddMetadata:
    def __init__(self, extra: Sequence[tuple[str, str]]) -> None:
        self.extra = extra

    async def _call(self, continuation: Callable[..., Any], details: Any, request: Any) -> Any:
        return await continuation(_with_metadata(details, self.extra), request)


class _Unary(_AddMetadata, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await self._call(continuation, details, request)


class _UnaryStream(_AddMetadata, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await self._call(continuation, details, request)


class _StreamUnary(_AddMetadata, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return await self._call(continuation, details, requests)


class _StreamStream(_AddMetadata, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return await self._call(continuation, details, requests)


def metadata_interceptors(extra: Sequence[tuple[str, str]]) -> list[Any]:
    """Client interceptors that add ``extra`` to every call of a grpc.aio channel (one per
    call kind: a channel files each interceptor under its first kind only)."""
    if not extra:
        return []
    return [_Unary(extra), _UnaryStream(extra), _StreamUnary(extra), _StreamStream(extra)]


def cluster_metadata(secret: str | None) -> tuple[tuple[str, str], ...]:
    """What an internal call carries: the cluster secret, if there is one."""
    return ((CLUSTER_SECRET_KEY, secret),) if secret else ()


# ---- exposure


def is_loopback(host: str) -> bool:
    """Whether ``host`` is reachable from this machine only ("localhost", 127.0.0.0/8,
    ::1); "", "0.0.0.0", "::" and any other name or address are not."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def exposure_warning(
    what: str, host: str, port: int | str, *, is_authenticated: bool, options: str
) -> str | None:
    """The one-line warning for ``what`` listening beyond loopback unauthenticated; None
    when it is bound to loopback or authenticated."""
    if is_authenticated or is_loopback(host):
        return None
    return (
        f"warning: {what} at {host}:{port}: no authentication, anyone who can reach it can "
        f"call it; add {options}"
    )

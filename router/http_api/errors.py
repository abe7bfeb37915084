"""The HTTP API's errors and the middlewares that refuse before a route runs.

Errors are OpenAI-shaped (``HttpError``): the router's gRPC statuses map to HTTP ones here
(``http_error``), pydantic's complaints about a body name its field (``body_error``), and
a 429 or 503 says when to retry. ``BearerAuth`` refuses a /v1/* request without the token
before its body is read; ``BodyLimit`` refuses a body over the limit as it streams in.
"""

from __future__ import annotations

import hmac
import math
from collections.abc import Sequence
from typing import Any

import grpc  # type: ignore[import-untyped]  # no types-grpcio in the dev extra
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from router.http_api.protocol import HttpError
from serving.rpc import retry_after_s, status_of, trailing_metadata_of
from tandem_client.wire import DEFAULT_RETRY_AFTER_S

HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 503,  # a worker set up unlike the router
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.CANCELLED: 503,  # by a worker (a client that left gets nothing)
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
# The gRPC fields a router message starts with, as OpenAI names them.
PARAM_NAMES = {"text": "prompt", "token_ids": "prompt", "chat": "messages"}


def http_error(exc: BaseException) -> HttpError:
    """The router's refusal (a ValidationError, Overloaded, a worker's status...) as HTTP."""
    if isinstance(exc, HttpError):
        return exc
    code, message = status_of(exc)
    status = HTTP_STATUS.get(code, 500)
    param = None
    if status == 400:
        name, colon, _ = message.partition(":")
        if colon and name.isidentifier():
            param = PARAM_NAMES.get(name, name)
            message = f"{param}:{message.split(':', 1)[1]}"
    error = HttpError(status, message, param=param, code=code.name.lower())
    error.retry_after_s = retry_after_s(trailing_metadata_of(exc))
    return error


def error_response(error: HttpError) -> JSONResponse:
    """The error as JSON; a 429 or 503 says when to retry (Retry-After, whole seconds:
    the server's hint rounded up, else DEFAULT_RETRY_AFTER_S)."""
    headers = None
    if error.status in (429, 503):
        wait_s = error.retry_after_s or DEFAULT_RETRY_AFTER_S
        headers = {"Retry-After": str(max(1, math.ceil(wait_s)))}
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


class BearerAuth:
    """ASGI middleware: a /v1/* request without ``Authorization: Bearer TOKEN`` gets an
    OpenAI-shaped 401 (compared in constant time); other paths pass."""

    def __init__(self, app: ASGIApp, token: str) -> None:
        self.app = app
        self.expected = f"Bearer {token}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and str(scope.get("path", "")).startswith("/v1/"):
            sent = next((v for k, v in scope.get("headers", ()) if k == b"authorization"), b"")
            if not hmac.compare_digest(sent, self.expected):
                error = HttpError(
                    401,
                    "authentication: send the router's token as 'Authorization: Bearer TOKEN' "
                    "(an OpenAI client's api_key)",
                    code="invalid_api_key",
                )
                headers = {"WWW-Authenticate": "Bearer"}
                response = JSONResponse(error.body(), status_code=401, headers=headers)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodyLimit:
    """ASGI middleware: a body over ``max_bytes`` (declared, or counted as it arrives) gets
    an OpenAI-shaped 413 before anything parses it."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = next((v for k, v in scope.get("headers", ()) if k == b"content-length"), b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(scope, receive, send)
            return
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                raise _TooLarge(self.max_bytes)
            return message

        await self.app(scope, counted, send)  # FastAPI answers _TooLarge (on_http_exception)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        await error_response(_TooLarge(self.max_bytes).error())(scope, receive, send)


class _TooLarge(StarletteHTTPException):
    def __init__(self, max_bytes: int) -> None:
        super().__init__(413, f"body: over the router's limit of {max_bytes} bytes")

    def error(self) -> HttpError:
        return HttpError(413, str(self.detail), code="too_large")


def body_error(errors: Sequence[Any]) -> HttpError:
    """pydantic's first complaint about a body, naming the field (``messages.0.role``)."""
    first: dict[str, Any] = dict(errors[0]) if errors else {"loc": ("body",), "msg": "?"}
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    if first.get("type") == "json_invalid":
        return HttpError(400, f"body: not valid JSON: {first.get('ctx', {}).get('error', '')}")
    param = ".".join(loc) or None
    message = f"{param}: {first.get('msg')}" if param else str(first.get("msg"))
    return HttpError(400, message, param=param, code="invalid_value")

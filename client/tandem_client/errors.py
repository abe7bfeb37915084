"""The SDK's exceptions: one class per kind of failure a caller handles differently,
mapped from the gRPC status code the router answered with (serving/rpc.py maps the
server's side)."""

from __future__ import annotations

import grpc  # type: ignore[import-untyped]  # no types-grpcio in the dev extra

from tandem_client.wire import RETRY_AFTER_MS_KEY


class TandemError(Exception):
    """A call failed: ``code`` is the gRPC status code, ``message`` the server's details.
    Raised as is for codes without a class of their own (INTERNAL, ABORTED, ...)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


class InvalidRequest(TandemError):
    """The request is wrong (INVALID_ARGUMENT, OUT_OF_RANGE): the message names the field;
    retrying it unchanged fails again."""


class Overloaded(TandemError):
    """The cluster has no room now (RESOURCE_EXHAUSTED): retry later or elsewhere, after
    ``retry_after_s`` (the server's hint; None when it gave none)."""

    retry_after_s: float | None = None


class Unavailable(TandemError):
    """The router cannot be reached, or has no worker to route to (UNAVAILABLE), after
    the client's retries."""


class DeadlineExceeded(TandemError):
    """The call's deadline passed before its last chunk (DEADLINE_EXCEEDED); the server
    has cancelled the request."""


class Unauthenticated(TandemError):
    """The credentials were refused (UNAUTHENTICATED, PERMISSION_DENIED)."""


class Cancelled(TandemError):
    """The call was cancelled (CANCELLED), by this client or the server."""


class NotFound(TandemError):
    """An unknown request, model or health service (NOT_FOUND)."""


_ERROR_BY_CODE: dict[grpc.StatusCode, type[TandemError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequest,
    grpc.StatusCode.OUT_OF_RANGE: InvalidRequest,
    grpc.StatusCode.RESOURCE_EXHAUSTED: Overloaded,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: Unauthenticated,
    grpc.StatusCode.CANCELLED: Cancelled,
    grpc.StatusCode.NOT_FOUND: NotFound,
}


def error_for(code: grpc.StatusCode, message: str) -> TandemError:
    """The exception for status ``code`` with the server's ``message``."""
    return _ERROR_BY_CODE.get(code, TandemError)(code, message)


def error_from_rpc(error: grpc.RpcError) -> TandemError:
    """The exception for a failed call (sync ``grpc.RpcError`` or ``grpc.aio.AioRpcError``)."""
    code = error.code()
    found = error_for(code, error.details() or code.name)
    if isinstance(found, Overloaded):
        for key, value in error.trailing_metadata() or ():
            if key == RETRY_AFTER_MS_KEY and isinstance(value, str) and value.isdigit():
                found.retry_after_s = int(value) / 1000
    return found

"""What the sync and async clients share: channel credentials, the metadata every call
carries, one call's deadline across its attempts, and the retry rule."""

from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc  # type: ignore[import-untyped]  # no types-grpcio in the dev extra

# Messages bounded as the servers bound theirs (serving/rpc.py), and reconnection at most
# 1 s apart: a retry after UNAVAILABLE finds a router that came back (gRPC's default
# reconnect backoff grows to 2 minutes, failing every call fast meanwhile).
CHANNEL_OPTIONS: tuple[tuple[str, Any], ...] = (
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
)

Pem = bytes | os.PathLike[str]  # PEM contents, or the path of a PEM file


@dataclass(frozen=True)
class Tls:
    """TLS to the router: ``root_certificates`` to verify it (None: the system's roots),
    and for mTLS this client's ``certificate_chain`` and ``private_key`` (both or neither).
    ``server_name`` overrides the name the router's certificate is checked against."""

    root_certificates: Pem | None = None
    certificate_chain: Pem | None = None
    private_key: Pem | None = None
    server_name: str | None = None

    def __post_init__(self) -> None:
        if (self.certificate_chain is None) != (self.private_key is None):
            raise ValueError("certificate_chain, private_key: give both (mTLS) or neither")

    def credentials(self) -> Any:
        """grpc channel credentials (the files read now)."""
        return grpc.ssl_channel_credentials(
            _read(self.root_certificates), _read(self.private_key), _read(self.certificate_chain)
        )

    def options(self) -> tuple[tuple[str, Any], ...]:
        """Channel options this TLS setting adds."""
        if self.server_name is None:
            return ()
        return (("grpc.ssl_target_name_override", self.server_name),)


def _read(pem: Pem | None) -> bytes | None:
    if pem is None or isinstance(pem, bytes):
        return pem
    return Path(pem).read_bytes()


@dataclass(frozen=True)
class RetryPolicy:
    """Retries of calls answered UNAVAILABLE before their first chunk: exponential
    backoff with full jitter, within the call's deadline."""

    max_retries: int = 5
    backoff_s: float = 0.25  # the first pause is drawn from [0, backoff_s]
    max_backoff_s: float = 4.0

    def __post_init__(self) -> None:
        if self.max_retries < 0 or self.backoff_s < 0 or self.max_backoff_s < 0:
            raise ValueError(f"max_retries, backoff_s, max_backoff_s: must be >= 0, got {self}")

    def pause_s(self, num_retries: int) -> float:
        """Full jitter: uniform in [0, min(max_backoff_s, backoff_s * 2**num_retries)]."""
        return random.uniform(0.0, min(self.max_backoff_s, self.backoff_s * 2**num_retries))


@dataclass(frozen=True)
class Settings:
    """A client's settings, fixed at construction."""

    address: str
    timeout_s: float | None  # every call's default deadline; None: none
    retry: RetryPolicy
    token: str | None  # bearer token, sent as `authorization: Bearer <token>`
    tls: Tls | None  # None: plaintext

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        """What every call carries."""
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()

    @property
    def channel_options(self) -> tuple[tuple[str, Any], ...]:
        """Options of the client's channel."""
        return CHANNEL_OPTIONS + (self.tls.options() if self.tls else ())

    def attempts(self, timeout_s: float | None) -> Attempts:
        """A new call's attempts, under its own ``timeout_s`` or else the client's."""
        return Attempts(self.timeout_s if timeout_s is None else timeout_s, self.retry)


def settings(
    address: str,
    *,
    timeout: float | None,
    max_retries: int,
    backoff_s: float,
    token: str | None,
    tls: Tls | bool,
) -> Settings:
    """The Settings of a client's constructor arguments (``tls=True``: the system's roots)."""
    if timeout is not None and timeout <= 0:
        raise ValueError(f"timeout: must be > 0 seconds or None, got {timeout}")
    retry = RetryPolicy(max_retries=max_retries, backoff_s=backoff_s)
    return Settings(address, timeout, retry, token, Tls() if tls is True else (tls or None))


class Attempts:
    """One call's deadline, shared by its attempts, and whether a failed one is retried."""

    def __init__(self, timeout_s: float | None, retry: RetryPolicy) -> None:
        self.deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self.retry = retry
        self.num_retries = 0

    def remaining_s(self) -> float | None:
        """What is left of the deadline (None: no deadline)."""
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    def pause_before_retry(self, error: grpc.RpcError) -> float | None:
        """Seconds to wait before the next attempt after ``error``, or None to raise it:
        only UNAVAILABLE is retried, ``max_retries`` times, and never past the deadline."""
        if error.code() != grpc.StatusCode.UNAVAILABLE:
            return None
        if self.num_retries >= self.retry.max_retries:
            return None
        pause = self.retry.pause_s(self.num_retries)
        remaining = self.remaining_s()
        if remaining is not None and pause >= remaining:
            return None
        self.num_retries += 1
        return pause

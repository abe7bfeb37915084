"""The Python SDK: ``TandemClient`` (blocking) and ``AsyncTandemClient`` (asyncio), each
owning one channel to a router.

    with TandemClient("127.0.0.1:50050") as client:
        print(client.generate("Hello", max_tokens=8, temperature=0).text)

Every call has a deadline (the client's ``timeout``, or the call's own), is retried with
backoff while the router answers UNAVAILABLE before its first chunk, and fails with a
``TandemError`` subclass (tandem_client.errors) carrying the status code and message.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any, TypeVar, Unpack

import grpc  # type: ignore[import-untyped]  # no types-grpcio in the dev extra

# grpcio-health-checking is a dependency of tandem-client: it needs only grpcio and
# protobuf, and its stubs are gRPC's own (no hand-written method path to keep in step).
from grpc_health.v1 import health_pb2, health_pb2_grpc  # type: ignore[import-untyped]

from tandem.v1 import generation_pb2 as gen
from tandem.v1 import generation_pb2_grpc as gen_grpc
from tandem_client.connection import Attempts, Settings, Tls, settings
from tandem_client.errors import error_from_rpc
from tandem_client.request import Prompt, SamplingKwargs, build_request
from tandem_client.results import Chunk, Completion, ModelInfo

DEFAULT_TIMEOUT_S = 600.0

T = TypeVar("T")


class TandemClient:
    """A blocking client of a Tandem router; a context manager that closes its channel.

    ``timeout``: every call's default deadline in seconds (None: none). ``max_retries``
    and ``backoff_s``: retries of UNAVAILABLE before the first chunk, with exponential
    backoff and full jitter. ``token``: sent as ``authorization: Bearer <token>``.
    ``tls``: True for TLS with the system's roots, or a ``Tls`` (custom roots, mTLS)."""

    def __init__(
        self,
        address: str,
        *,
        timeout: float | None = DEFAULT_TIMEOUT_S,
        max_retries: int = 5,
        backoff_s: float = 0.25,
        token: str | None = None,
        tls: Tls | bool = False,
    ) -> None:
        self.settings: Settings = settings(
            address,
            timeout=timeout,
            max_retries=max_retries,
            backoff_s=backoff_s,
            token=token,
            tls=tls,
        )
        self._channel = _open_channel(grpc, self.settings)
        self._generation = gen_grpc.GenerationStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    def __enter__(self) -> TandemClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Closes the channel; calls in flight are cancelled."""
        self._channel.close()

    def generate(
        self,
        prompt: Prompt,
        *,
        request_id: str | None = None,
        model: str = "",
        timeout: float | None = None,
        **sampling: Unpack[SamplingKwargs],
    ) -> Completion:
        """The whole completion of ``prompt`` (text, token ids, or chat messages as
        {"role", "content"} dicts); keywords are sampling parameters (max_tokens,
        temperature, ...), an unknown one a TypeError. ``timeout``: this call's deadline."""
        chunks = self.stream(
            prompt, request_id=request_id, model=model, timeout=timeout, **sampling
        )
        return Completion.join(
            chunks,
            has_logprobs=sampling.get("logprobs") is not None,
            has_prompt_logprobs=sampling.get("prompt_logprobs") is not None,
        )

    def stream(
        self,
        prompt: Prompt,
        *,
        request_id: str | None = None,
        model: str = "",
        timeout: float | None = None,
        **sampling: Unpack[SamplingKwargs],
    ) -> Iterator[Chunk]:
        """The completion's chunks as they come (arguments as ``generate``'s); the request
        is checked now, sent on the first ``next``. Closing the iterator early (``break``)
        cancels the request on the server. A retry resends the same request, with the
        same ``request_id``: the router ended the failed attempt before answering
        UNAVAILABLE, so the id is free again."""
        request = build_request(prompt, request_id=request_id, model=model, **sampling)
        return self._stream(request, self.settings.attempts(timeout))

    def models(self, *, timeout: float | None = None) -> list[ModelInfo]:
        """The models the router serves, its default first."""
        reply = self._unary(self._generation.ListModels, gen.ListModelsRequest(), timeout)
        return [ModelInfo.from_proto(m) for m in reply.models]

    def health(self, service: str = "", *, timeout: float | None = None) -> str:
        """The router's grpc.health.v1 status: "SERVING", "NOT_SERVING" (draining, or not
        ready yet)...; ``service`` "" asks about the server as a whole."""
        request = health_pb2.HealthCheckRequest(service=service)
        reply = self._unary(self._health.Check, request, timeout)
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))

    def _stream(self, request: gen.GenerateRequest, attempts: Attempts) -> Iterator[Chunk]:
        metadata = self.settings.metadata
        while True:
            call = self._generation.Generate(
                request, timeout=attempts.remaining_s(), metadata=metadata
            )
            is_started = False
            try:
                for message in call:
                    is_started = True
                    yield Chunk.from_proto(message)
                return
            except grpc.RpcError as e:
                pause = None if is_started else attempts.pause_before_retry(e)
                if pause is None:
                    raise error_from_rpc(e) from e
            finally:
                call.cancel()  # no-op once finished; else the server stops the request
            time.sleep(pause)

    def _unary(self, method: Callable[..., T], request: Any, timeout: float | None) -> T:
        attempts = self.settings.attempts(timeout)
        while True:
            try:
                return method(
                    request, timeout=attempts.remaining_s(), metadata=self.settings.metadata
                )
            except grpc.RpcError as e:
                pause = attempts.pause_before_retry(e)
                if pause is None:
                    raise error_from_rpc(e) from e
            time.sleep(pause)


class AsyncTandemClient:
    """An asyncio client of a Tandem router (grpc.aio); an async context manager that
    closes its channel. Arguments as ``TandemClient``'s; create it inside the event loop
    that uses it."""

    def __init__(
        self,
        address: str,
        *,
        timeout: float | None = DEFAULT_TIMEOUT_S,
        max_retries: int = 5,
        backoff_s: float = 0.25,
        token: str | None = None,
        tls: Tls | bool = False,
    ) -> None:
        self.settings: Settings = settings(
            address,
            timeout=timeout,
            max_retries=max_retries,
            backoff_s=backoff_s,
            token=token,
            tls=tls,
        )
        self._channel = _open_channel(grpc.aio, self.settings)
        self._generation = gen_grpc.GenerationStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    async def __aenter__(self) -> AsyncTandemClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Closes the channel; calls in flight are cancelled."""
        await self._channel.close()

    async def generate(
        self,
        prompt: Prompt,
        *,
        request_id: str | None = None,
        model: str = "",
        timeout: float | None = None,
        **sampling: Unpack[SamplingKwargs],
    ) -> Completion:
        """The whole completion of ``prompt`` (as ``TandemClient.generate``)."""
        chunks = self.stream(
            prompt, request_id=request_id, model=model, timeout=timeout, **sampling
        )
        joined = [chunk async for chunk in chunks]
        return Completion.join(
            joined,
            has_logprobs=sampling.get("logprobs") is not None,
            has_prompt_logprobs=sampling.get("prompt_logprobs") is not None,
        )

    def stream(
        self,
        prompt: Prompt,
        *,
        request_id: str | None = None,
        model: str = "",
        timeout: float | None = None,
        **sampling: Unpack[SamplingKwargs],
    ) -> AsyncIterator[Chunk]:
        """The completion's chunks as they come, an async iterator (arguments as
        ``TandemClient.generate``'s); the request is checked now. Leaving the ``async
        for`` early cancels the request on the server (at once with
        ``contextlib.aclosing``, else when the iterator is collected)."""
        request = build_request(prompt, request_id=request_id, model=model, **sampling)
        return self._stream(request, self.settings.attempts(timeout))

    async def models(self, *, timeout: float | None = None) -> list[ModelInfo]:
        """The models the router serves, its default first."""
        reply = await self._unary(self._generation.ListModels, gen.ListModelsRequest(), timeout)
        return [ModelInfo.from_proto(m) for m in reply.models]

    async def health(self, service: str = "", *, timeout: float | None = None) -> str:
        """The router's grpc.health.v1 status (as ``TandemClient.health``)."""
        request = health_pb2.HealthCheckRequest(service=service)
        reply = await self._unary(self._health.Check, request, timeout)
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))

    async def _stream(
        self, request: gen.GenerateRequest, attempts: Attempts
    ) -> AsyncIterator[Chunk]:
        metadata = self.settings.metadata
        while True:
            call = self._generation.Generate(
                request, timeout=attempts.remaining_s(), metadata=metadata
            )
            is_started = False
            try:
                async for message in call:
                    is_started = True
                    yield Chunk.from_proto(message)
                return
            except grpc.aio.AioRpcError as e:
                pause = None if is_started else attempts.pause_before_retry(e)
                if pause is None:
                    raise error_from_rpc(e) from e
            finally:
                call.cancel()  # no-op once finished; else the server stops the request
            await asyncio.sleep(pause)

    async def _unary(
        self, method: Callable[..., Awaitable[T]], request: Any, timeout: float | None
    ) -> T:
        attempts = self.settings.attempts(timeout)
        while True:
            try:
                return await method(
                    request, timeout=attempts.remaining_s(), metadata=self.settings.metadata
                )
            except grpc.aio.AioRpcError as e:
                pause = attempts.pause_before_retry(e)
                if pause is None:
                    raise error_from_rpc(e) from e
            await asyncio.sleep(pause)


def _open_channel(grpc_module: Any, settings: Settings) -> Any:
    """A channel to ``settings.address`` from ``grpc`` or ``grpc.aio`` (same names in both),
    with TLS when ``settings`` has it."""
    options = settings.channel_options
    if settings.tls is not None:
        credentials = settings.tls.credentials()
        return grpc_module.secure_channel(settings.address, credentials, options=options)
    return grpc_module.insecure_channel(settings.address, options=options)

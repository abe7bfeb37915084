"""Helper functions over the raw wire messages, sync and async (no torch): what the CLI
and the cluster tests use. Applications use the SDK (tandem_client.sdk) instead.

for chunk in generate("127.0.0.1:50050", "Hello", max_tokens=8, temperature=0):
    print(chunk.text, end="")
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc  # type: ignore[import-untyped]  # no types-grpcio in the dev extra

from tandem.v1 import generation_pb2 as gen
from tandem.v1 import generation_pb2_grpc as gen_grpc
from tandem_client.request import Prompt, build_request

__all__ = ["Prompt", "agenerate", "build_request", "collect", "generate", "wait_until_serving"]


def generate(
    address: str, prompt: Prompt, *, timeout: float | None = 600.0, **kwargs: Any
) -> Iterator[gen.GenerateChunk]:
    """Streams the chunks of one completion (blocking)."""
    with grpc.insecure_channel(address) as channel:
        stub = gen_grpc.GenerationStub(channel)
        yield from stub.Generate(build_request(prompt, **kwargs), timeout=timeout)


async def agenerate(
    address_or_channel: str | grpc.aio.Channel,
    prompt: Prompt,
    *,
    timeout: float | None = 600.0,
    **kwargs: Any,
) -> AsyncIterator[gen.GenerateChunk]:
    """Streams the chunks of one completion (asyncio); pass a channel to reuse one."""
    if isinstance(address_or_channel, str):
        async with grpc.aio.insecure_channel(address_or_channel) as channel:
            async for chunk in _stream(channel, prompt, timeout, kwargs):
                yield chunk
    else:
        async for chunk in _stream(address_or_channel, prompt, timeout, kwargs):
            yield chunk


async def _stream(
    channel: grpc.aio.Channel, prompt: Prompt, timeout: float | None, kwargs: dict[str, Any]
) -> AsyncIterator[gen.GenerateChunk]:
    call = gen_grpc.GenerationStub(channel).Generate(
        build_request(prompt, **kwargs), timeout=timeout
    )
    try:
        async for chunk in call:
            yield chunk
    finally:
        call.cancel()  # no-op once finished; propagates an abandoned iteration to the server


def collect(chunks: Iterator[gen.GenerateChunk]) -> tuple[list[int], str, gen.GenerateChunk]:
    """Token ids, text and the last chunk of a finished stream."""
    ids: list[int] = []
    text = ""
    last = gen.GenerateChunk()
    for chunk in chunks:
        ids.extend(chunk.token_ids)
        text += chunk.text
        last = chunk
    return ids, text, last


def wait_until_serving(address: str, timeout_s: float) -> None:
    """Blocks until ``address``'s grpc.health.v1 says SERVING; TimeoutError past
    ``timeout_s`` (0: ask once)."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc  # type: ignore[import-untyped]

    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"router {address}: not SERVING after {timeout_s:.0f} s")
            time.sleep(0.5)

"""A minimal client of tandem.v1.Generation, sync and async.

It lives here, not in the `tandem-client` distribution, because it needs the generated
`tandem.v1` stubs, which only the server distribution installs for now.

    for chunk in generate("127.0.0.1:50050", "Hello", max_tokens=8, temperature=0):
        print(chunk.text, end="")
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import grpc  # type: ignore[import-untyped]  # no types-grpcio in the dev extra

from tandem.v1 import generation_pb2 as gen
from tandem.v1 import generation_pb2_grpc as gen_grpc

Prompt = str | Sequence[int] | Sequence[dict[str, str]]


def build_request(
    prompt: Prompt, *, request_id: str = "", model: str = "", **params: Any
) -> gen.GenerateRequest:
    """A GenerateRequest: text, token ids, or chat messages ({"role", "content"} dicts);
    keyword arguments are SamplingParams fields (max_tokens, temperature, stop, ...)."""
    request = gen.GenerateRequest(
        request_id=request_id, model=model, sampling=gen.SamplingParams(**params)
    )
    if isinstance(prompt, str):
        request.text = prompt
    elif prompt and isinstance(prompt[0], dict):
        request.chat.messages.extend(gen.ChatMessage(**m) for m in prompt)  # type: ignore[arg-type]
    else:
        request.token_ids.ids.extend(int(t) for t in prompt)  # type: ignore[arg-type]
    return request


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


def _retry_unavailable(
    address: str, prompt: Prompt, params: dict[str, Any], deadline: float
) -> Iterator[gen.GenerateChunk]:
    """``generate``, tried again while the router answers UNAVAILABLE before any chunk
    (its workers are still starting) until ``deadline`` (monotonic)."""
    while True:
        chunks = generate(address, prompt, **params)
        try:
            first = next(chunks)
        except StopIteration:
            return
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                raise
            time.sleep(1.0)
            continue
        yield first
        yield from chunks
        return


def generate_cli(args: argparse.Namespace) -> int:
    """`tandem generate --router HOST:PORT`: each prompt's answer printed as it streams,
    then tokens, time to first token and tokens per second."""
    params: dict[str, Any] = {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_k": args.top_k,
        "top_p": args.top_p,
        "min_p": args.min_p,
        "stop": args.stop,
        "ignore_eos": args.ignore_eos,
    }
    if args.seed is not None:
        params["seed"] = args.seed
    deadline = time.monotonic() + args.wait
    try:
        wait_until_serving(args.router, args.wait)
        for text in args.prompts:
            prompt: Prompt = text if args.chat is False else [{"role": "user", "content": text}]
            print(f">>> {text}", flush=True)
            start = time.perf_counter()
            first = None
            num_tokens = 0
            for chunk in _retry_unavailable(args.router, prompt, params, deadline):
                if first is None and chunk.token_ids:
                    first = time.perf_counter() - start
                num_tokens += len(chunk.token_ids)
                print(chunk.text, end="", flush=True)
            elapsed = time.perf_counter() - start
            print(
                f"\n[{num_tokens} tokens in {elapsed:.2f} s, first after "
                f"{1e3 * (first or 0.0):.0f} ms, {num_tokens / elapsed:.1f} tok/s]\n",
                flush=True,
            )
    except grpc.RpcError as e:
        print(f"tandem generate: error: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    except TimeoutError as e:
        print(f"tandem generate: error: {e}; is `tandem serve` running?", file=sys.stderr)
        return 1
    return 0

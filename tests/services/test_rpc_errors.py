"""One interceptor maps every servicer exception to a status code, the server survives
each of them, and the engine loop's bounded queue answers Overloaded."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
import redis

from engine.kv_cache import KVCacheCapacityError
from engine.outputs import NON_FINITE_LOGITS, RequestFailed
from engine.sampling_params import SamplingParams, SamplingParamsError
from kv_transfer.base import KvTransferError
from ledger.ledger import LedgerConflict
from serving.engine_loop import EngineLoop
from serving.rpc import Overloaded, Unavailable, kv_push_status, new_server, status_of
from tandem.v1 import generation_pb2 as gen
from tandem.v1 import generation_pb2_grpc as gen_grpc
from tandem.v1 import kv_transfer_pb2 as kv_pb
from tests.serving.commands import Cleanup, Do

RAISED: list[tuple[BaseException, grpc.StatusCode]] = [
    (ValueError("prompt: is empty"), grpc.StatusCode.INVALID_ARGUMENT),
    (SamplingParamsError("top_p: must be in (0, 1]"), grpc.StatusCode.INVALID_ARGUMENT),
    (KVCacheCapacityError("kv cache: full"), grpc.StatusCode.RESOURCE_EXHAUSTED),
    (Overloaded("queue: full"), grpc.StatusCode.RESOURCE_EXHAUSTED),
    (LedgerConflict("request r: expected QUEUED"), grpc.StatusCode.ABORTED),
    (TimeoutError("deadline"), grpc.StatusCode.DEADLINE_EXCEEDED),
    (RuntimeError("secret internals"), grpc.StatusCode.INTERNAL),
]


def test_a_request_the_engine_failed_alone_is_internal_and_says_why() -> None:
    code, message = status_of(RequestFailed(NON_FINITE_LOGITS))
    assert code == grpc.StatusCode.INTERNAL and message == NON_FINITE_LOGITS


def test_status_of_maps_subclasses_before_value_error() -> None:
    for exc, code in RAISED:
        assert status_of(exc)[0] == code, exc
    code, message = status_of(RuntimeError("secret internals"))
    assert "secret" not in message and "RuntimeError" in message


def test_an_unreachable_ledger_is_unavailable_and_says_so() -> None:
    refused = redis.ConnectionError("Error 111 connecting to 127.0.0.1:1. Connection refused.")
    code, message = status_of(refused)
    assert code == grpc.StatusCode.UNAVAILABLE
    assert message.startswith("the ledger's Redis is unreachable (Error 111 connecting")
    assert status_of(redis.TimeoutError("Timeout reading from socket"))[0] == code
    assert status_of(redis.ResponseError("WRONGTYPE"))[0] == grpc.StatusCode.INTERNAL


class Raising(gen_grpc.GenerationServicer):
    """Raises RAISED[i] for request_id "i", before or after a first chunk."""

    async def Generate(self, request: gen.GenerateRequest, context: Any) -> AsyncIterator[Any]:
        index = int(request.request_id)
        if request.model == "after-first":
            yield gen.GenerateChunk(request_id=request.request_id)
        raise RAISED[index][0]

    async def ListModels(self, request: gen.ListModelsRequest, context: Any) -> Any:
        raise RAISED[int(request.ByteSize())][0]


async def test_interceptor_answers_each_exception_and_server_survives() -> None:
    server, _ = new_server(1 << 20)
    gen_grpc.add_GenerationServicer_to_server(Raising(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = gen_grpc.GenerationStub(channel)
            for where in ("", "after-first"):
                for i, (exc, code) in enumerate(RAISED):
                    request = gen.GenerateRequest(request_id=str(i), model=where)
                    with pytest.raises(grpc.aio.AioRpcError) as info:
                        async for _ in stub.Generate(request, timeout=5):
                            pass
                    assert info.value.code() == code
                    if code != grpc.StatusCode.INTERNAL:
                        assert info.value.details() == str(exc)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.ListModels(gen.ListModelsRequest(), timeout=5)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # RAISED[0], unary
    finally:
        await server.stop(0)


class Relaying(gen_grpc.GenerationServicer):
    """Raises KvTransferError(STALE_EPOCH) for request "push", Unavailable otherwise; with
    ``downstream`` set, calls that server instead and lets its error go up, as the prefill
    worker does with a decode worker's refusal."""

    def __init__(self, downstream: str | None = None) -> None:
        self.downstream = downstream

    async def Generate(self, request: gen.GenerateRequest, context: Any) -> AsyncIterator[Any]:
        if self.downstream is not None:
            async with grpc.aio.insecure_channel(self.downstream) as channel:
                async for chunk in gen_grpc.GenerationStub(channel).Generate(request, timeout=5):
                    yield chunk
        elif request.request_id == "push":
            raise KvTransferError(kv_pb.KV_PUSH_STATUS_STALE_EPOCH, "epoch 3 is not 4")
        else:
            raise Unavailable("draining")


async def test_a_refused_push_is_told_apart_two_hops_up() -> None:
    """The router tells D refusing P's push from P failing by trailing metadata, not by
    the message: it reaches the caller of the caller with the status."""
    servers: list[Any] = []
    try:
        address: str | None = None  # the decode worker, then the prefill worker calling it
        for _ in range(2):
            server, _ = new_server(1 << 20)
            gen_grpc.add_GenerationServicer_to_server(Relaying(downstream=address), server)
            address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
            await server.start()
            servers.append(server)
        assert address is not None
        async with grpc.aio.insecure_channel(address) as channel:
            stub = gen_grpc.GenerationStub(channel)
            found = {}
            for request_id in ("push", "other"):
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    async for _ in stub.Generate(gen.GenerateRequest(request_id=request_id)):
                        pass
                assert info.value.code() == grpc.StatusCode.UNAVAILABLE
                found[request_id] = (kv_push_status(info.value), info.value.details())
        assert found == {
            "push": ("KV_PUSH_STATUS_STALE_EPOCH", "KV_PUSH_STATUS_STALE_EPOCH: epoch 3 is not 4"),
            "other": (None, "draining"),
        }
    finally:
        for server in servers:
            await server.stop(0)


def idle_engine() -> Any:
    """Just enough of LLMEngine for EngineLoop; no request ever runs."""
    return SimpleNamespace(
        block_manager=SimpleNamespace(num_blocks=8, total_blocks=8, num_free_blocks=8),
        scheduler=SimpleNamespace(running=[], waiting=[], config=SimpleNamespace(max_num_seqs=4)),
        spec=None,
        has_unfinished_requests=lambda: False,
        wants_cost_refresh=lambda: False,
    )


async def test_engine_loop_bounds_new_work_but_never_cleanup() -> None:
    loop = EngineLoop(
        idle_engine(),
        asyncio.get_running_loop(),
        on_step=lambda engine, deltas: deltas,
        deliver=lambda payload: None,
        on_error=lambda error: None,
        max_queued_calls=2,
    )
    futures = [loop.submit(Do(SamplingParams)) for _ in range(2)]  # not started yet
    with pytest.raises(Overloaded, match="2 calls waiting"):
        loop.submit(Do(SamplingParams))
    cleanup = loop.submit(Cleanup(lambda: "freed"))
    failing = loop.submit(Cleanup(lambda: SamplingParams(0)))  # max_tokens 0: refused
    loop.start()
    try:
        assert isinstance(await futures[0], SamplingParams)
        assert await cleanup == "freed"
        with pytest.raises(SamplingParamsError, match="max_tokens"):
            await failing
    finally:
        loop.stop()


def test_reflection_lists_the_services_only_when_asked() -> None:
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
        ProtoReflectionDescriptorDatabase,
    )

    async def services(reflected: tuple[str, ...]) -> list[str]:
        server, _ = new_server(1 << 20, reflected)
        gen_grpc.add_GenerationServicer_to_server(Raising(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                database = ProtoReflectionDescriptorDatabase(channel)
                return await asyncio.to_thread(lambda: sorted(database.get_services()))
        except grpc.RpcError as e:
            return [e.code().name]
        finally:
            await server.stop(0)

    assert asyncio.run(services(("tandem.v1.Generation",))) == [
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
        "tandem.v1.Generation",
    ]
    assert asyncio.run(services(())) == ["UNIMPLEMENTED"]


async def test_bytes_that_do_not_parse_are_an_invalid_argument() -> None:
    """``1a 01 ff``: field 3 (text), one byte long, not UTF-8. grpc itself would answer
    UNKNOWN naming the Python class, and log a traceback per request."""
    server, _ = new_server(1 << 20)
    gen_grpc.add_GenerationServicer_to_server(Raising(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            raw = channel.unary_stream("/tandem.v1.Generation/Generate")
            with pytest.raises(grpc.aio.AioRpcError) as info:
                async for _ in raw(b"\x1a\x01\xff", timeout=5):
                    pass
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert info.value.details() == (
                "request: not a valid message for /tandem.v1.Generation/Generate "
                "(DecodeError); send the serialized request message of the method"
            )
            unary = channel.unary_unary("/tandem.v1.Generation/ListModels")
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await unary(b"\xff\xff\xff", timeout=5)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            stub = gen_grpc.GenerationStub(channel)  # still serving
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.ListModels(gen.ListModelsRequest(), timeout=5)
            assert info.value.details() == str(RAISED[0][0])
    finally:
        await server.stop(0)

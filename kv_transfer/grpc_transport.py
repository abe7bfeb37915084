"""KV over gRPC: the KvTransfer servicer (decode worker), one Push call's stream, and the
channel that carries chunk data in the stream's messages (prefill).

Chunk messages skip protobuf's copies of the data (wire.py): the sender appends the data
field straight from its chunk buffer, the receiver checks and writes it from the received
bytes.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc  # type: ignore[import-untyped]  # no types-grpcio in the dev extra
import torch

from kv_transfer.base import KvLayout, KvTransferError
from kv_transfer.chunking import ChunkedKvSender, Destination, Tamper, TransferOptions
from kv_transfer.receiver import KvReceiver
from kv_transfer.wire import encode_chunk_message
from tandem.v1 import kv_transfer_pb2 as pb

SERVICE = "tandem.v1.KvTransfer"
PUSH_METHOD = f"/{SERVICE}/Push"


def server_options(max_message_bytes: int = TransferOptions.max_message_bytes) -> list[Any]:
    """Options of a grpc server that mounts the servicer: room for a chunk plus extras."""
    return [("grpc.max_receive_message_length", max_message_bytes)]


class KvTransferServicer:
    """Thin: one Push is one ``KvReceiver.receive``. Requests stay bytes (no deserializer)
    so that chunk data is checked and written from the received buffer, not a copy; the
    receiver's answer to a same-host handshake goes out as initial metadata."""

    def __init__(self, receiver: KvReceiver) -> None:
        self.receiver = receiver

    async def Push(self, request_iterator: AsyncIterator[bytes], context: Any) -> pb.KvPushReply:
        async def announce(metadata: Sequence[tuple[str, str | bytes]]) -> None:
            await context.send_initial_metadata(metadata)

        return await self.receiver.receive(request_iterator, announce)


def add_kv_transfer_servicer(server: grpc.aio.Server, receiver: KvReceiver) -> KvTransferServicer:
    """Mounts tandem.v1.KvTransfer (as the generated add_KvTransferServicer_to_server does,
    less the request deserializer)."""
    servicer = KvTransferServicer(receiver)
    handlers = {
        "Push": grpc.stream_unary_rpc_method_handler(
            servicer.Push,
            request_deserializer=None,
            response_serializer=pb.KvPushReply.SerializeToString,
        )
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    server.add_registered_method_handlers(SERVICE, handlers)
    return servicer


class PushStream:
    """One Push call: a writer task keeps up to ``window`` serialized messages queued."""

    def __init__(self, channel: grpc.aio.Channel, options: TransferOptions) -> None:
        # Requests are bytes we serialized; replies parse as KvPushReply.
        self._push = channel.stream_unary(
            PUSH_METHOD, request_serializer=None, response_deserializer=pb.KvPushReply.FromString
        )
        self.options = options
        self.call: Any = None
        self._queue: asyncio.Queue[bytes | None] = asyncio.Queue(maxsize=options.window)
        self._writer: asyncio.Task[None] | None = None
        self._write_error: BaseException | None = None

    def start(self) -> None:
        self.call = self._push(timeout=self.options.timeout_s)
        self._writer = asyncio.create_task(self._write_loop())

    @property
    def is_broken(self) -> bool:
        """Writes failed or the call ended (a refusal: its reply says why)."""
        return self._write_error is not None or self.call.done()

    async def put(self, message: bytes) -> None:
        if self._write_error is not None:
            raise await self.failure()
        await self._queue.put(message)

    async def flush(self) -> None:
        """Until every queued message was written."""
        await self._queue.join()

    async def finish(self, last: pb.KvChunk) -> pb.KvPushReply:
        """Sends the last message, half-closes, and returns the reply."""
        await self.put(pb.KvPushMessage(chunk=last).SerializeToString())
        await self._queue.put(None)
        assert self._writer is not None
        await self._writer
        if self._write_error is not None:
            raise await self.failure()
        try:
            await self.call.done_writing()
            reply: pb.KvPushReply = await self.call
        except grpc.aio.AioRpcError as e:
            raise _rpc_error(e) from e
        return reply

    def cancel(self) -> None:
        if self.call is not None:
            self.call.cancel()
        if self._writer is not None:
            self._writer.cancel()

    async def _write_loop(self) -> None:
        """Writes queued messages in order; after a failed write it only drains the queue."""
        while (message := await self._queue.get()) is not None:
            if self._write_error is None:
                try:
                    await self.call.write(message)
                except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as e:
                    self._write_error = e
            self._queue.task_done()

    async def failure(self) -> KvTransferError:
        """Why writes stopped: the receiver's early reply (a refusal) or the RPC's error."""
        try:
            reply: pb.KvPushReply = await self.call
        except grpc.aio.AioRpcError as e:
            return _rpc_error(e)
        return KvTransferError(reply.status, reply.message or "the receiver ended the push")


class GrpcChannel:
    """Chunk data in the stream's messages, serialized from one staging buffer."""

    groups_layers = True

    def __init__(self, channel: grpc.aio.Channel, options: TransferOptions) -> None:
        self.options = options
        self.stream = PushStream(channel, options)
        self._staging = torch.empty(0, dtype=torch.uint8)

    async def open(self, handshake: pb.KvHandshake, layout: KvLayout) -> Destination | None:
        self.stream.start()
        await self.stream.put(pb.KvPushMessage(handshake=handshake).SerializeToString())
        return None

    async def acquire(self, num_bytes: int) -> torch.Tensor:
        if self._staging.numel() < num_bytes:  # one buffer: a chunk is serialized before the next
            self._staging = torch.frombuffer(bytearray(max(num_bytes, 1)), dtype=torch.uint8)
        return self._staging[:num_bytes]

    async def send(self, header: pb.KvChunk, data: torch.Tensor | None) -> None:
        assert data is not None, "a gRPC chunk carries its data"
        message = encode_chunk_message(header, data.numpy().data)
        await self.stream.put(message)

    async def close(self, last: pb.KvChunk) -> pb.KvPushReply:
        return await self.stream.finish(last)

    def on_failed(self, status: int, message: str) -> None:
        self.stream.cancel()


def grpc_sender(
    channel: grpc.aio.Channel,
    options: TransferOptions | None = None,
    *,
    tamper: Tamper | None = None,
) -> ChunkedKvSender:
    """A sender whose chunks travel in the Push stream."""
    options = options or TransferOptions()
    return ChunkedKvSender(GrpcChannel(channel, options), options, tamper)


def _rpc_error(e: grpc.aio.AioRpcError) -> KvTransferError:
    return KvTransferError(pb.KV_PUSH_STATUS_INCOMPLETE, f"rpc {e.code().name}: {e.details()}")

"""KV over gRPC: the KvTransfer servicer (decode worker) and the streaming sender (prefill).

Chunk messages skip protobuf's copies of the data (wire.py): the sender appends the data
field straight from its chunk buffer, the receiver checks and writes it from the received
bytes.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc  # type: ignore[import-untyped]  # no types-grpcio in the dev extra
import torch

from kv_transfer.base import Handshake, KvTransferError
from kv_transfer.chunking import ChunkingKvSender, Tamper, TransferOptions
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
    so that chunk data is checked and written from the received buffer, not a copy."""

    def __init__(self, receiver: KvReceiver) -> None:
        self.receiver = receiver

    async def Push(self, request_iterator: AsyncIterator[bytes], context: Any) -> pb.KvPushReply:
        return await self.receiver.receive(request_iterator)


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


class GrpcKvSender(ChunkingKvSender):
    """Streams one push; a writer task keeps up to ``window`` serialized chunks queued."""

    def __init__(
        self,
        channel: grpc.aio.Channel,
        options: TransferOptions | None = None,
        *,
        tamper: Tamper | None = None,
    ) -> None:
        super().__init__(options or TransferOptions(), tamper)
        # Requests are bytes we serialized; replies parse as KvPushReply.
        self._push = channel.stream_unary(
            PUSH_METHOD, request_serializer=None, response_deserializer=pb.KvPushReply.FromString
        )
        self._call: Any = None
        self._queue: asyncio.Queue[bytes | None] = asyncio.Queue(maxsize=self.options.window)
        self._writer: asyncio.Task[None] | None = None
        self._write_error: BaseException | None = None
        self._staging = torch.empty(0, dtype=torch.uint8)

    def _handshake(self, handshake: Handshake) -> pb.KvHandshake:
        return handshake.layout.to_handshake(
            handshake.request_id, handshake.decode_epoch, self.checksum_kind
        )

    async def _open(self, handshake: Handshake) -> None:
        self._call = self._push(timeout=self.options.timeout_s)
        self._writer = asyncio.create_task(self._write_loop())
        message = pb.KvPushMessage(handshake=self._handshake(handshake))
        await self._put(message.SerializeToString())

    async def _acquire(self, num_bytes: int) -> torch.Tensor:
        if self._staging.numel() < num_bytes:  # one buffer: a chunk is serialized before the next
            self._staging = torch.frombuffer(bytearray(max(num_bytes, 1)), dtype=torch.uint8)
        return self._staging[:num_bytes]

    async def _send_chunk(self, header: pb.KvChunk, data: torch.Tensor) -> None:
        await self._put(await self._offload(self._encode, header, data))

    @staticmethod
    def _encode(header: pb.KvChunk, data: torch.Tensor) -> bytes:
        return encode_chunk_message(header, data.numpy().data)

    async def _close(self, last: pb.KvChunk) -> pb.KvPushReply:
        await self._put(pb.KvPushMessage(chunk=last).SerializeToString())
        await self._queue.put(None)
        assert self._writer is not None
        await self._writer
        if self._write_error is not None:
            raise await self._failure()
        try:
            await self._call.done_writing()
            reply: pb.KvPushReply = await self._call
        except grpc.aio.AioRpcError as e:
            raise _rpc_error(e) from e
        return reply

    def _on_failed(self) -> None:
        if self._call is not None:
            self._call.cancel()
        if self._writer is not None:
            self._writer.cancel()

    async def _put(self, message: bytes) -> None:
        if self._write_error is not None:
            raise await self._failure()
        await self._queue.put(message)

    async def _write_loop(self) -> None:
        """Writes queued messages in order; after a failed write it only drains the queue."""
        while (message := await self._queue.get()) is not None:
            if self._write_error is None:
                try:
                    await self._call.write(message)
                except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as e:
                    self._write_error = e
            self._queue.task_done()

    async def _failure(self) -> KvTransferError:
        """Why writes stopped: the receiver's early reply (a refusal) or the RPC's error."""
        try:
            reply: pb.KvPushReply = await self._call
        except grpc.aio.AioRpcError as e:
            return _rpc_error(e)
        return KvTransferError(reply.status, reply.message or "the receiver ended the push")


def _rpc_error(e: grpc.aio.AioRpcError) -> KvTransferError:
    return KvTransferError(pb.KV_PUSH_STATUS_INCOMPLETE, f"rpc {e.code().name}: {e.details()}")

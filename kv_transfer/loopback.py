"""Same-process transport: direct pool-to-pool copies through the receiver's checks.

For tests of code that sends or receives KV (prefill and decode workers, migration)
without a network; no serialization and no checksums.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

import torch

from kv_transfer.base import (
    Handshake,
    KvPool,
    KvSender,
    KvTransferError,
    TransferState,
    merge_runs,
)
from kv_transfer.receiver import KvReceiver, ReceiveSession
from tandem.v1 import kv_transfer_pb2 as pb

T = TypeVar("T")


class LoopbackTransport:
    """Makes senders that write straight into ``receiver``'s reserved pools."""

    def __init__(self, receiver: KvReceiver) -> None:
        self.receiver = receiver

    def sender(self) -> LoopbackKvSender:
        return LoopbackKvSender(self.receiver)


class LoopbackKvSender(KvSender):
    def __init__(self, receiver: KvReceiver) -> None:
        super().__init__()
        self._receiver = receiver
        self._session: ReceiveSession | None = None
        self._start = 0.0

    async def begin(self, handshake: Handshake) -> None:
        if self.state is not TransferState.RESERVED:
            raise RuntimeError(f"begin: the transfer is {self.state.value}")
        self._start = time.perf_counter()
        self.state = TransferState.TRANSFERRING
        wire = handshake.layout.to_handshake(
            handshake.request_id, handshake.decode_epoch, pb.CHECKSUM_KIND_CRC32
        )
        self._session = self._run(lambda: self._receiver.open(wire))

    async def send_layer(
        self,
        pool: KvPool,
        layer: int,
        src_cache_layer: tuple[torch.Tensor, torch.Tensor],
        src_block_ids: Sequence[int],
        dst_block_ids: Sequence[int],
    ) -> None:
        session = self._active()
        runs = merge_runs(src_block_ids, dst_block_ids)
        if runs:
            self.num_bytes_sent += self._run(
                lambda: session.write_direct(pool, layer, src_cache_layer, runs)
            )
            self.num_chunks_sent += 1

    async def finish(self, extra_tensors: Mapping[str, torch.Tensor] | None = None) -> None:
        session = self._active()
        extra = {name: t.detach().clone() for name, t in (extra_tensors or {}).items()}
        self._run(lambda: session.complete(extra))
        self.seconds = time.perf_counter() - self._start
        self.state = TransferState.DONE

    async def abort(self, reason: str) -> None:
        if self.state is TransferState.TRANSFERRING:
            if self._session is not None:
                self._session.fail(pb.KV_PUSH_STATUS_INCOMPLETE, f"sender aborted: {reason}")
            self.state, self.message = TransferState.FAILED, f"aborted: {reason}"

    def _active(self) -> ReceiveSession:
        if self.state is not TransferState.TRANSFERRING or self._session is None:
            raise RuntimeError(f"the transfer is {self.state.value}, not transferring")
        return self._session

    def _run(self, step: Callable[[], T]) -> T:
        try:
            return step()
        except KvTransferError as e:
            if self._session is not None:
                self._session.fail(e.status, e.message)
            self.state, self.message = TransferState.FAILED, e.message
            self.seconds = time.perf_counter() - self._start
            raise

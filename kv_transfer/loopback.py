"""Same-process channel: blocks go straight into the receiver's reserved pools, through the
receiver's checks (checksums included), with no network; for tests of code that sends or
receives KV (prefill and decode workers, migration)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kv_transfer.base import KvLayout, KvPool, RunPair
from kv_transfer.chunking import ChunkedKvSender, Destination, TransferOptions
from kv_transfer.copying import byte_view
from kv_transfer.receiver import KvReceiver, ReceiveSession
from tandem.v1 import kv_transfer_pb2 as pb

_EMPTY = memoryview(b"")


class LoopbackTransport:
    """Makes senders that write straight into ``receiver``'s reserved pools."""

    def __init__(self, receiver: KvReceiver, options: TransferOptions | None = None) -> None:
        self.receiver = receiver
        self.options = options or TransferOptions()

    def sender(self) -> ChunkedKvSender:
        return ChunkedKvSender(LoopbackChannel(self.receiver), self.options)


class LoopbackChannel:
    """Each layer is a chunk of its own, checked by the receiver as soon as it is sent, so a
    refusal surfaces in the ``send_layer`` that caused it. CPU pools are written in place;
    others through a staging buffer the receiver copies from."""

    groups_layers = False

    def __init__(self, receiver: KvReceiver) -> None:
        self._receiver = receiver
        self._session: ReceiveSession | None = None
        self._pools: dict[KvPool, Sequence[tuple[torch.Tensor, ...]]] = {}

    async def open(self, handshake: pb.KvHandshake, layout: KvLayout) -> Destination | None:
        session = self._session = self._receiver.open(handshake)
        pools = session.pools
        self._pools = {pool: pools[pool].layers for pool in KvPool if pool in pools}
        is_cpu = all(
            byte_view(t) is not None for layers in self._pools.values() for kv in layers for t in kv
        )
        if not is_cpu:
            return None
        session.is_placed = True
        return _Local(self._pools, session)

    async def acquire(self, num_bytes: int) -> torch.Tensor:
        return torch.empty(num_bytes, dtype=torch.uint8)

    async def send(self, header: pb.KvChunk, data: torch.Tensor | None) -> None:
        assert self._session is not None
        payload = _EMPTY if data is None else memoryview(data.numpy().data)
        self._session.on_chunk(header, payload)

    async def close(self, last: pb.KvChunk) -> pb.KvPushReply:
        assert self._session is not None
        self._session.on_chunk(last, _EMPTY)
        return self._session.reply(pb.KV_PUSH_STATUS_OK, "")

    def on_failed(self, status: int, message: str) -> None:
        if self._session is not None:
            self._session.fail(status, message)


class _Local:
    """The receiver's own pools as a Destination: its checks run before each write."""

    def __init__(
        self,
        pools: dict[KvPool, Sequence[tuple[torch.Tensor, ...]]],
        session: ReceiveSession,
    ) -> None:
        self._pools = pools
        self._session = session

    def layer(self, pool: KvPool, layer: int) -> tuple[torch.Tensor, ...]:
        return self._pools[pool][layer]

    async def check(self, pool: KvPool, layer: int, runs: Sequence[RunPair]) -> None:
        dst_runs = [(r.dst_start, r.num_blocks) for r in runs]
        self._session.check_runs(pool, layer, layer + 1, dst_runs)

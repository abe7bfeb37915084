"""The KV channel between a prefill and a decode worker that share one engine (a co-located
worker): the prefill computes the prompt's KV straight into the blocks the decode side
reserved, so nothing is sent, copied or checksummed. What the channel carries is the
reservation's progress through the receiver's states, as any push moves it: opened
(TRANSFERRING: the reservation exists, at this epoch, with this layout), then written
(DONE) or failed. The decode side waits for it as it waits for any push (``wait_done``).
"""

from __future__ import annotations

from kv_transfer.base import Handshake, KvTransferError
from kv_transfer.receiver import KvReceiver
from kv_transfer.session import ReceiveSession
from tandem.v1 import kv_transfer_pb2 as pb


class InPlaceChannel:
    """Opens in-place hand-overs into ``receiver``'s reservations (see the module's
    docstring); lives on the event loop that serves the receiver."""

    def __init__(self, receiver: KvReceiver) -> None:
        self.receiver = receiver

    def open(self, handshake: Handshake) -> InPlaceHandOver:
        """Raises KvTransferError as a push's handshake would: no such reservation, a
        stale epoch, another layout, a push already under way."""
        wire = handshake.to_wire(pb.CHECKSUM_KIND_CRC32)
        return InPlaceHandOver(self.receiver.open(wire))


class InPlaceHandOver:
    """One request's hand-over: ``written`` once the engine computed its blocks, or
    ``fail``; the first of them acts."""

    def __init__(self, session: ReceiveSession) -> None:
        self._session = session
        self._is_ended = False

    async def until_ended(self) -> None:
        """Returns once the reservation waits for this hand-over no more: it was written,
        failed, or dropped (the decode side closed the request)."""
        await self._session.ended()

    def check_live(self) -> None:
        """Raises KvTransferError once the reservation was dropped or failed."""
        self._session.check_live()

    def written(self) -> None:
        """Raises KvTransferError when the reservation was dropped meanwhile."""
        if not self._is_ended:
            self._is_ended = True
            self._session.written_in_place()

    def fail(self, message: str) -> None:
        if not self._is_ended:
            self._is_ended = True
            self._session.fail(pb.KV_PUSH_STATUS_INCOMPLETE, message)


__all__ = ["InPlaceChannel", "InPlaceHandOver", "KvTransferError"]

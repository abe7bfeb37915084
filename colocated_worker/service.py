"""A co-located worker: ``tandem.v1.DecodeWorker`` and ``tandem.v1.PrefillWorker`` served by
one process over one engine.

The router routes to it as to any prefill and decode worker pair (D.Reserve, P.Prefill,
D.Decode), and its requests go through the same ledger states. What differs is the KV
channel: the prefill side computes the prompt straight into the blocks the decode side
reserved, and hands them over in process (``kv_transfer.in_place``), as a same-host
decode worker would take them through shared memory. The two sides share the engine's
thread and loop (each step's deltas go to both), the registration (one worker id, a
decode worker whose heartbeat says ``prefills_in_place``) and the receiver.
"""

from __future__ import annotations

import asyncio
from typing import Any

from decode_worker.service import DecodeWorkerService
from ledger.membership import HeldRequest
from prefill_worker.in_place import InPlacePrefillService


class ColocatedWorkerService:
    """Both sides, served and run as one (serving.component.Service)."""

    def __init__(self, decode: DecodeWorkerService, prefill: InPlacePrefillService) -> None:
        self.decode = decode
        self.prefill = prefill
        self.served_name = decode.served_name
        self.engine_loop = decode.engine_loop  # one engine thread for both sides

    def add_to(self, server: Any) -> None:
        self.decode.add_to(server)
        self.prefill.add_to(server)

    def start(self) -> None:
        self.decode.start()

    async def housekeeping(self) -> None:
        await self.decode.housekeeping()

    async def drain(self, timeout_s: float) -> None:
        """Refuses new requests on both sides; waits for those in flight on both."""
        await asyncio.gather(self.prefill.drain(timeout_s), self.decode.drain(timeout_s))

    async def close(self) -> None:
        await self.decode.close()

    def load(self) -> tuple[float, dict[str, str | int | float]]:
        return self.decode.load()

    async def held_requests(self) -> list[HeldRequest]:
        return await self.decode.held_requests()

    def on_lease_lost(self, request_id: str) -> None:
        self.decode.on_lease_lost(request_id)

    def on_registered(self, epoch: int) -> None:
        self.decode.on_registered(epoch)

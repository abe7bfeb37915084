"""`python -m tests.chaos.held_decode_worker --held-log PATH [decode worker options]`: a real
decode worker whose end of every KV push stops after the handshake, as one whose receiver
stopped taking chunks: it reads nothing more of the push until the sender gives up and
cancels the call. Each held push's request id is appended to PATH (one a line). All else
(Reserve, Decode, Abort, Stats, the ledger, the receiver's cleanup) is the worker's own."""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from decode_worker.cli import main
from kv_transfer.grpc_transport import KvTransferServicer
from tandem.v1 import kv_transfer_pb2 as pb


def hold_pushes(held_log: Path) -> None:
    """Every KvTransfer.Push served from now on takes its handshake and then nothing."""
    push = KvTransferServicer.Push

    async def held_push(
        self: KvTransferServicer, messages: AsyncIterator[bytes], context: Any
    ) -> pb.KvPushReply:
        return await push(self, _handshake_only(messages, held_log), context)

    KvTransferServicer.Push = held_push  # type: ignore[method-assign]


async def _handshake_only(messages: AsyncIterator[bytes], held_log: Path) -> AsyncIterator[bytes]:
    async for message in messages:
        with held_log.open("a") as log:
            log.write(pb.KvPushMessage.FromString(message).handshake.request_id + "\n")
        yield message
        break
    await asyncio.Event().wait()  # until the call is cancelled


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m tests.chaos.held_decode_worker")
    parser.add_argument("--held-log", type=Path, required=True)
    known, rest = parser.parse_known_args()
    hold_pushes(known.held_log)
    sys.exit(main(rest))

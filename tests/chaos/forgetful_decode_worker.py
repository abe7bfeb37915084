"""`python -m tests.chaos.forgetful_decode_worker --forgot-log PATH [decode worker options]`:
a real decode worker that drops each request's reservation once, just as its Decode call
arrives, the way the worker's membership drops one whose ledger record it lost (a Redis
restart, a lapsed lease): ``on_lease_lost``. That Decode call then meets the worker's own
answer to an unknown reservation. Each dropped request id is appended to PATH (one a line);
a request sent here again is served. All else is the worker's own."""

from __future__ import annotations

import argparse
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from decode_worker.cli import main
from decode_worker.service import DecodeWorkerService
from tandem.v1 import generation_pb2 as gen
from tandem.v1 import worker_pb2 as pb


def forget_once(forgot_log: Path) -> None:
    """Every DecodeWorker.Decode served from now on first drops its request's reservation,
    once per request id."""
    decode = DecodeWorkerService.Decode
    forgotten: set[str] = set()

    async def forgetful_decode(
        self: DecodeWorkerService, request: pb.DecodeRequest, context: Any
    ) -> AsyncIterator[gen.GenerateChunk]:
        if request.request_id not in forgotten:
            forgotten.add(request.request_id)
            with forgot_log.open("a") as log:
                log.write(request.request_id + "\n")
            self.on_lease_lost(request.request_id)
        async for chunk in decode(self, request, context):
            yield chunk

    DecodeWorkerService.Decode = forgetful_decode  # type: ignore[method-assign]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m tests.chaos.forgetful_decode_worker")
    parser.add_argument("--forgot-log", type=Path, required=True)
    known, rest = parser.parse_known_args()
    forget_once(known.forgot_log)
    sys.exit(main(rest))

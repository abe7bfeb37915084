"""What the router asks a prefill worker (``Route.prefill_request``): the prompt and what
was already streamed, and everything the decode worker's Reserve reply says the push
needs: its blocks, epoch, host (shared memory) and the GPU its pools are on (CUDA IPC)."""

from __future__ import annotations

import time

from ledger.ledger import WorkerInfo, WorkerRole
from router.route import Route
from router.validation import ValidRequest
from tandem.v1 import generation_pb2 as gen
from tandem.v1 import worker_pb2 as pb


def worker(worker_id: str, role: WorkerRole, address: str) -> WorkerInfo:
    return WorkerInfo(worker_id, role, address, 64, 0.0, 3, 0, 0, {})


def test_the_prefill_request_carries_what_the_decode_worker_reserved() -> None:
    sampling = gen.SamplingParams(temperature=0.5, seed=11)
    valid = ValidRequest("r1", [5, 6, 7], sampling, max_tokens=9)
    route = Route(
        valid,
        worker("p0", WorkerRole.PREFILL, "10.0.0.1:50051"),
        worker("d0", WorkerRole.DECODE, "10.0.0.2:50061"),
        time.monotonic() + 30,
        output_tokens_sent=[8, 9],  # a resumed request: prefilled with its output so far
    )
    reserve = pb.ReserveReply(
        block_ids=[4, 2, 9],
        num_cached_blocks=1,
        epoch=17,
        block_size=16,
        host_id="host-a",
        kv_pools_bus_id="0000:19:00.0",
    )
    asked = route.prefill_request("smollm2", reserve)
    assert asked == pb.PrefillRequest(
        request_id="r1",
        model="smollm2",
        prompt_token_ids=[5, 6, 7, 8, 9],
        sampling=sampling,
        decode_address="10.0.0.2:50061",
        decode_block_ids=[4, 2, 9],
        num_cached_blocks=1,
        decode_epoch=17,
        decode_worker_id="d0",
        decode_host_id="host-a",
        decode_kv_pools_bus_id="0000:19:00.0",
        num_output_tokens_sent=2,
    )

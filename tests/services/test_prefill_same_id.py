"""A request id prefilled again while its earlier attempt is still inside an engine step: the
router retries a failed prefill, and may pick this worker again at once. The earlier
attempt's abort waits behind the step, so that step still writes layers for the id. The
new attempt's push must see only its own layers (a push given a step's later layers
without its first has no window for them, and one given the whole step would send the old
attempt's blocks while they are freed). Real engines on both ends, the gRPC stream between
them, a real ledger; the engine thread is held inside the old step by its layer listener."""

from __future__ import annotations

import asyncio
import itertools
import threading
from pathlib import Path
from typing import Any

import grpc
import pytest

from engine.llm_engine import EngineConfig, LLMEngine
from engine.sampling_params import SamplingParams
from kv_transfer import (
    KvLayout,
    KvReceiver,
    KvReservation,
    KvTransferError,
    TransferState,
    add_kv_transfer_servicer,
    server_options,
)
from ledger.ledger import Ledger, RequestState, WorkerRole
from ledger.membership import Membership, Timing
from prefill_worker.service import PrefillWorkerService
from tandem.v1 import generation_pb2 as gen
from tandem.v1 import worker_pb2 as pb
from tests.engine.joined import drain_joined
from tests.engine.tiny_models import build_tiny_llama

BLOCK_SIZE = 4
PROMPT = [(7 * i + 3) % 61 + 2 for i in range(21)]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("same_id") / "target"
    build_tiny_llama(out, "gqa4_llama3rope_hd72_mlpbias", num_layers=3, vocab_size=64)
    return out


def make_engine(target: Path) -> LLMEngine:
    config = EngineConfig(
        model=str(target), dtype="float32", block_size=BLOCK_SIZE, kv_cache_memory=1 << 21
    )
    return LLMEngine(config)


def layout_of(engine: LLMEngine) -> KvLayout:
    return KvLayout.of_pools("tiny", engine.kv_pools["target"])


class _Context:
    """The part of a gRPC servicer context that Prefill reads: the time left."""

    def time_remaining(self) -> float:
        return 30.0


def run_alone(engine: LLMEngine, rid: str) -> list[int]:
    out: list[int] = []
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished and o.request_id == rid:
                out = o.token_ids
    return out


async def test_a_retry_of_the_same_id_sees_only_its_own_layers(
    target: Path, ledger: Ledger
) -> None:
    prefill, decode, whole = make_engine(target), make_engine(target), make_engine(target)
    whole.add_request("ref", PROMPT, GREEDY)
    expected = run_alone(whole, "ref")

    receiver = KvReceiver(stall_s=30.0)
    server = grpc.aio.server(options=server_options())
    add_kv_transfer_servicer(server, receiver)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    membership = Membership(
        ledger, "p0", role=WorkerRole.PREFILL, address="127.0.0.1:1", capacity=8,
        timing=Timing(heartbeat_ms=1000, lease_ms=5000),
    )  # fmt: skip
    membership.register()
    ledger.create_request("r", owner="router-0", epoch=1)
    ledger.transition(
        "r", RequestState.PREFILLING, expected=RequestState.QUEUED, epoch=1,
        new_owner="p0", new_epoch=membership.epoch,
    )  # fmt: skip
    service = PrefillWorkerService(
        prefill, served_name="tiny", layout=layout_of(prefill), draft=None,
        membership=membership, use_shm=False,
    )  # fmt: skip
    relay: Any = prefill.runner.layer_listener
    in_step, go_on = threading.Event(), threading.Event()
    calls = itertools.count()

    def held(pool: str, layer: int, step: Any) -> None:
        if next(calls) == 1:  # the first attempt's step, after its first layer
            in_step.set()
            go_on.wait(30)
        relay(pool, layer, step)

    prefill.set_layer_listener(held)

    def attempt() -> pb.PrefillRequest:
        dst, num_cached = decode.reserve("r", PROMPT, GREEDY)
        receiver.reserve(KvReservation("r", dst, decode.kv_pools, layout_of(decode)))
        return pb.PrefillRequest(
            request_id="r", model="tiny", prompt_token_ids=PROMPT,
            sampling=gen.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
            decode_address=f"127.0.0.1:{port}", decode_block_ids=dst,
            num_cached_blocks=num_cached, decode_worker_id="d0",
        )  # fmt: skip

    service.start()
    try:
        first = asyncio.create_task(service.Prefill(attempt(), _Context()))
        assert await asyncio.to_thread(in_step.wait, 30)
        first.cancel()  # as the router's retry does; its abort now waits behind the step
        # It ends cancelled; or, where the cancellation reaches it only once its push is
        # finishing (a host slow enough for the held step to give up waiting), with the
        # push's failure: the receiver has failed the request meanwhile.
        with pytest.raises((asyncio.CancelledError, KvTransferError)):
            await first
        # The first push never completes. The receiver ends it when the cancellation
        # reaches it, or when the router's retry releases the reservation (its Abort to
        # the decode worker), as here: over loopback on one event loop, gRPC does not
        # always deliver the cancellation (the receiver then waits for a first chunk).
        assert receiver.state("r") is not TransferState.DONE
        released = receiver.drop("r")
        if released is not None:
            await asyncio.wait_for(released, 10)
        decode.drop_request("r")

        second = asyncio.create_task(service.Prefill(attempt(), _Context()))
        while "r" not in service._tasks:  # its push is open: the old step may go on
            await asyncio.sleep(0.01)
        go_on.set()
        reply = await asyncio.wait_for(second, 30)
        await receiver.wait_done("r", timeout=5.0)
        assert reply.first_token_id == expected[0]
        receiver.drop("r")
        first = decode.start_decoding("r", reply.first_token_id, None)
        assert drain_joined(decode, [first])["r"].token_ids == expected
    finally:
        go_on.set()
        service.engine_loop.stop()
        await server.stop(0)

"""A prefill worker's push whose engine stops (prefill_worker/kv_push.py): with real engines
on both ends and the gRPC stream between them, the engine computes the first of three
prompt chunks and then no more, or none at all, as a stuck engine thread would. The push
fails within its progress deadline naming the stall (Unavailable: the router passes this
worker over and prefills the request elsewhere), the receiver fails the reservation as soon
as the abort reaches it, and both engines get every block back once the request is dropped
(as the prefill worker's Prefill and the decode worker's reservation expiry do). A request
queued behind another's long prompt for longer than the deadline is not stalled: the
engine writes that prompt's layers meanwhile. A chunk corrupted after its checksum fails
the push the same way on both sides, named as such."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import torch

from engine.llm_engine import EngineConfig, LLMEngine
from engine.sampling_params import SamplingParams
from kv_transfer import (
    Handshake,
    KvLayout,
    KvReceiver,
    KvReservation,
    KvTransferError,
    TransferOptions,
    TransferState,
    add_kv_transfer_servicer,
    grpc_sender,
    server_options,
)
from kv_transfer.chunking import Tamper, stalled
from prefill_worker.kv_push import LayerPush, LayerRelay
from serving.rpc import Unavailable, status_of, trailing_metadata_of
from tandem.v1 import kv_transfer_pb2 as pb
from tandem_client.wire import KV_PUSH_STATUS_KEY
from tests.engine.tiny_models import build_tiny_llama

BLOCK_SIZE = 4
PROMPT = [(7 * i + 3) % 61 + 2 for i in range(21)]  # 21 tokens: three chunks of 8
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
STALL_S = 0.3
# How the receiver sees a push whose sender gave up: as a cancelled call or, when the
# sender's half-close wins the race, as a stream with no last message. Both are INCOMPLETE.
CANCELLED_PUSH = (
    "INCOMPLETE: (the push was cancelled or broke|the stream ended before a message with is_last)$"
)


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("push_stall") / "target"
    build_tiny_llama(out, "gqa4_llama3rope_hd72_mlpbias", num_layers=3, vocab_size=64)
    return out


def make_engine(target: Path) -> LLMEngine:
    config = EngineConfig(
        model=str(target),
        dtype="float32",
        block_size=BLOCK_SIZE,
        kv_cache_memory=1 << 21,
        max_num_batched_tokens=8,
    )
    return LLMEngine(config)


def layout_of(engine: LLMEngine) -> KvLayout:
    return KvLayout.of_pools("tiny", engine.kv_pools["target"])


@pytest.fixture
async def receiving() -> AsyncIterator[tuple[KvReceiver, grpc.aio.Channel]]:
    receiver = KvReceiver(stall_s=30.0)  # the sender's deadline is the one under test
    server = grpc.aio.server(options=server_options())
    add_kv_transfer_servicer(server, receiver)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    yield receiver, channel
    await channel.close()
    await server.stop(0)


def start_push(
    prefill: LLMEngine,
    decode: LLMEngine,
    receiver: KvReceiver,
    channel: grpc.aio.Channel,
    tamper: Tamper | None = None,
    stall_s: float = STALL_S,
) -> LayerPush:
    """Reserves "r" on ``decode``, queues it on ``prefill`` with a push fed by its layers
    and clocked by the engine's, as the prefill worker's Prefill does."""
    dst, _ = decode.reserve("r", PROMPT, GREEDY)
    receiver.reserve(KvReservation("r", dst, decode.kv_pools, layout_of(decode)))
    relay = LayerRelay(asyncio.get_running_loop(), torch.device("cpu"), prefill.kv_pools)
    # The engine's deadline is under test: the transport's is far beyond it.
    options = TransferOptions(chunk_bytes=2048, window=2, timeout_s=30, stall_s=30)
    push = LayerPush(
        grpc_sender(channel, options, tamper=tamper),
        Handshake("r", layout_of(prefill)),
        prefill.kv_pools,
        dst,
        0,
        BLOCK_SIZE,
        asyncio.Semaphore(1),
        stall_s,
        engine_progress=lambda: relay.last_written_at,
    )
    relay.register("r", push)
    prefill.set_layer_listener(relay)
    prefill.add_request("r", PROMPT, GREEDY, is_prefill_only=True)
    return push


async def drop_request(
    push: LayerPush, prefill: LLMEngine, decode: LLMEngine, receiver: KvReceiver
) -> None:
    """What the workers do after a failed push: Prefill's cleanup aborts the request in
    the prefill engine; the decode worker's expiry releases the failed reservation and
    aborts it there. Every block of both engines is free after it."""
    await push.stop("prefill failed or was cancelled")
    prefill.drop_request("r")
    assert receiver.drop("r") is None  # no same-host writer: the blocks are free now
    decode.drop_request("r")
    for engine in (prefill, decode):
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


async def test_an_engine_that_stops_mid_prompt_stalls_the_push(
    target: Path, receiving: tuple[KvReceiver, grpc.aio.Channel]
) -> None:
    receiver, channel = receiving
    prefill, decode = make_engine(target), make_engine(target)
    push = start_push(prefill, decode, receiver, channel)
    await asyncio.to_thread(prefill.step)  # the first of three chunks, then no more steps
    stepped = time.monotonic()
    with pytest.raises(Unavailable) as stalled:
        await asyncio.wait_for(push.wait(), STALL_S + 5)
    # The clock started at the step's last layer, a little before the step returned.
    assert time.monotonic() - stepped < STALL_S + 2
    assert str(stalled.value) == (
        f"prefill worker: request r: stalled: nothing moved for {STALL_S:g} s while waiting "
        "for the engine's next layer (transfer_stall_s)"
    )
    assert push.sender.state is TransferState.FAILED
    assert push.sender.num_chunks_sent > 0  # the stall came mid-push, not before it
    with pytest.raises(KvTransferError, match=CANCELLED_PUSH):
        await receiver.wait_done("r", timeout=1.0)
    await drop_request(push, prefill, decode, receiver)


async def test_an_engine_that_never_starts_the_prompt_stalls_the_push(
    target: Path, receiving: tuple[KvReceiver, grpc.aio.Channel]
) -> None:
    """Admitted, the request's first layer must come within the deadline too: here the
    engine never steps again, so no layer of any request comes."""
    receiver, channel = receiving
    prefill, decode = make_engine(target), make_engine(target)
    started = time.monotonic()
    push = start_push(prefill, decode, receiver, channel)
    with pytest.raises(Unavailable) as stalled:
        await asyncio.wait_for(push.wait(), STALL_S + 5)
    assert STALL_S <= time.monotonic() - started < STALL_S + 2
    assert str(stalled.value) == (
        f"prefill worker: request r: stalled: nothing moved for {STALL_S:g} s while waiting "
        "for the engine's first layer (transfer_stall_s)"
    )
    assert push.sender.state is TransferState.FAILED
    assert push.sender.num_chunks_sent == 0
    with pytest.raises(KvTransferError, match=CANCELLED_PUSH):
        await receiver.wait_done("r", timeout=1.0)
    await drop_request(push, prefill, decode, receiver)


async def test_a_busy_engine_fails_no_push_queued_behind_others(
    target: Path, receiving: tuple[KvReceiver, grpc.aio.Channel]
) -> None:
    """Request r waits behind the 96-token prompt of "busy" (12 steps of 8 tokens) for over
    twice its deadline, while the engine steps busy's prompt about 5 times per deadline:
    its push does not fail, and its KV arrives whole once its turn comes."""
    receiver, channel = receiving
    prefill, decode = make_engine(target), make_engine(target)
    stall_s = 0.5
    busy = [(5 * i + 1) % 61 + 2 for i in range(96)]  # shares no block with PROMPT
    prefill.add_request("busy", busy, GREEDY, is_prefill_only=True)  # queued first
    started = time.monotonic()
    push = start_push(prefill, decode, receiver, channel, stall_s=stall_s)

    async def step() -> list[str]:
        outputs = await asyncio.to_thread(prefill.step)
        await asyncio.sleep(stall_s / 5)  # a slow engine, but one that runs
        return [output.request_id for output in outputs]

    while "busy" not in await step():  # its prompt's last chunk gives its first token
        assert not push.task.done()
    assert time.monotonic() - started > 2 * stall_s  # "r" had no layer all that time
    while "r" not in await step():
        pass
    assert await asyncio.wait_for(push.wait(), 5) == push.sender.num_bytes_sent > 0
    assert push.sender.state is TransferState.DONE
    await receiver.wait_done("r", timeout=1.0)
    prefill.drop_request("busy")
    await drop_request(push, prefill, decode, receiver)


async def test_a_corrupted_chunk_fails_the_push_on_both_sides(
    target: Path, receiving: tuple[KvReceiver, grpc.aio.Channel]
) -> None:
    receiver, channel = receiving
    prefill, decode = make_engine(target), make_engine(target)

    def flip_a_byte(sequence_number: int, data: torch.Tensor) -> None:
        if sequence_number == 1:
            data[5] ^= 0x10

    push = start_push(prefill, decode, receiver, channel, flip_a_byte)
    while prefill.has_unfinished_requests():
        await asyncio.to_thread(prefill.step)
    with pytest.raises(KvTransferError) as refused:
        await asyncio.wait_for(push.wait(), 5)
    assert refused.value.status == pb.KV_PUSH_STATUS_CHECKSUM_MISMATCH
    assert refused.value.message == "chunk 1: checksum differs from its data"
    assert push.sender.state is TransferState.FAILED
    with pytest.raises(KvTransferError, match="CHECKSUM_MISMATCH: chunk 1: checksum"):
        await receiver.wait_done("r", timeout=1.0)
    await drop_request(push, prefill, decode, receiver)


def test_stall_errors_reach_the_router_as_unavailable() -> None:
    """Both stalls end Prefill with UNAVAILABLE, which the router retries (a new P and D):
    the engine's without a push status (the router passes this prefill worker over), the
    transport's with one (the push failed, not P)."""
    engine = Unavailable(f"prefill worker: request r: {stalled(STALL_S, 'waiting')}")
    transport = KvTransferError(pb.KV_PUSH_STATUS_INCOMPLETE, stalled(STALL_S, "sending"))
    assert status_of(engine) == (grpc.StatusCode.UNAVAILABLE, str(engine))
    assert trailing_metadata_of(engine) == ()
    assert status_of(transport) == (grpc.StatusCode.UNAVAILABLE, str(transport))
    assert trailing_metadata_of(transport) == ((KV_PUSH_STATUS_KEY, "KV_PUSH_STATUS_INCOMPLETE"),)

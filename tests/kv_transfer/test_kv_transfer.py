"""KV transports: loopback, gRPC and shared memory move blocks bit for bit, and the
receiver refuses corruption, layout mismatches, foreign blocks and broken sequences."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Iterable
from pathlib import Path

import grpc
import pytest
import torch

from engine.kv_cache import PagedKVCache
from kv_transfer import (
    Handshake,
    KvLayout,
    KvPool,
    KvReceiver,
    KvReservation,
    KvTransferError,
    LoopbackTransport,
    ShmChannel,
    ShmRingPool,
    TransferOptions,
    TransferState,
    grpc_sender,
    host_id,
    make_sender,
    shm_sender,
)
from kv_transfer.base import KV_WIRE_VERSION, RunPair, merge_runs, split_runs
from kv_transfer.checksum import checksum_kind
from kv_transfer.wire import encode_chunk_message, split_push_message
from tandem.v1 import kv_transfer_pb2 as pb
from tests.kv_transfer.kv_pools import (
    DST_IDS,
    DST_SEED,
    SRC_IDS,
    SRC_SEED,
    Receiving,
    extra_tensors,
    layout_for,
    make_pools,
    mismatches,
    push_all,
)

REPO = Path(__file__).resolve().parents[2]
DTYPES = [torch.float32, torch.bfloat16]
# Small chunks: a target layer (9 blocks x 256 B in fp32) splits, draft layers group.
SMALL_CHUNKS = TransferOptions(chunk_bytes=1024, window=2, timeout_s=10)
GROUPED_LAYERS = TransferOptions(chunk_bytes=16 << 10, window=2, timeout_s=10)


@pytest.fixture
def rings() -> Iterable[ShmRingPool]:
    pool = ShmRingPool.for_options(SMALL_CHUNKS)
    yield pool
    pool.close()


def test_runs_merge_on_both_sides_and_split_at_block_bounds() -> None:
    runs = merge_runs(SRC_IDS, DST_IDS)
    assert runs == [
        RunPair(3, 10, 3),
        RunPair(9, 0, 1),
        RunPair(1, 6, 2),
        RunPair(12, 2, 1),
        RunPair(13, 4, 1),
        RunPair(14, 3, 1),
    ]
    groups = split_runs([RunPair(0, 10, 5), RunPair(7, 2, 1)], max_blocks=2)
    assert groups == [
        [RunPair(0, 10, 2)],
        [RunPair(2, 12, 2)],
        [RunPair(4, 14, 1), RunPair(7, 2, 1)],
    ]


def test_reservations_and_checksums_are_validated() -> None:
    layout = layout_for(torch.float32)
    pools = make_pools(layout, DST_SEED)
    with pytest.raises(ValueError, match="duplicates"):
        KvReservation("r", [1, 1], pools, layout)
    with pytest.raises(ValueError, match=r"outside 0\.\.15"):
        KvReservation("r", [16], pools, layout)
    with pytest.raises(ValueError, match="draft pool given without its layout"):
        KvReservation("r", [1], pools, KvLayout("tiny", torch.float32, 4, layout.target))
    assert checksum_kind("crc32") == pb.CHECKSUM_KIND_CRC32
    assert checksum_kind("auto") in (
        pb.CHECKSUM_KIND_CRC32,
        pb.CHECKSUM_KIND_CRC32C,
        pb.CHECKSUM_KIND_XXH3_64,
    )
    with pytest.raises(ValueError, match="unknown 'md5'"):
        checksum_kind("md5")


async def test_unknown_checksum_kind_is_refused() -> None:
    layout = layout_for(torch.float32)
    receiver = KvReceiver()
    receiver.reserve(KvReservation("r1", DST_IDS, make_pools(layout, DST_SEED), layout))
    messages = _chunks(layout, make_pools(layout, SRC_SEED))
    messages[0].handshake.checksum_kind = pb.CHECKSUM_KIND_UNSPECIFIED
    reply = await receiver.receive(_stream(messages))
    assert reply.status == pb.KV_PUSH_STATUS_INCOMPATIBLE
    assert reply.message == "checksum_kind: CHECKSUM_KIND_UNSPECIFIED unavailable"


def test_layout_mismatch_names_the_field() -> None:
    receiver, sender = layout_for(torch.float32), layout_for(torch.bfloat16)
    assert receiver.mismatch(receiver) is None
    assert receiver.mismatch(sender) == "dtype: sender has 'bfloat16', receiver expects 'float32'"
    assert receiver.fingerprint() != sender.fingerprint()
    wire = sender.to_handshake("r", 0, pb.CHECKSUM_KIND_CRC32)
    assert KvLayout.from_handshake(wire) == sender
    assert wire.wire_version == KV_WIRE_VERSION and wire.head_layout == "whole"


async def test_a_sender_of_another_wire_version_is_refused_naming_it() -> None:
    layout = layout_for(torch.float32)
    receiver = KvReceiver()
    receiver.reserve(KvReservation("r1", DST_IDS, make_pools(layout, DST_SEED), layout))
    messages = _chunks(layout, make_pools(layout, SRC_SEED))
    messages[0].handshake.wire_version = 0  # a sender from before versions
    reply = await receiver.receive(_stream(messages))
    assert reply.status == pb.KV_PUSH_STATUS_INCOMPATIBLE
    assert reply.message == f"wire_version: sender has 0, receiver expects {KV_WIRE_VERSION}"


async def test_a_sender_of_one_ranks_heads_is_refused_naming_the_head_layout() -> None:
    """Chunks carry every KV head, whatever either end's tensor-parallel ranks hold; a
    sender of some other split (none is built) cannot be mapped."""
    layout = layout_for(torch.float32)
    receiver = KvReceiver()
    receiver.reserve(KvReservation("r1", DST_IDS, make_pools(layout, DST_SEED), layout))
    messages = _chunks(layout, make_pools(layout, SRC_SEED))
    messages[0].handshake.head_layout = "rank 0 of 2"
    reply = await receiver.receive(_stream(messages))
    assert reply.status == pb.KV_PUSH_STATUS_INCOMPATIBLE
    assert reply.message == "head_layout: sender has 'rank 0 of 2', receiver expects 'whole'"


def test_chunk_data_is_appended_and_split_off_without_protobuf() -> None:
    header = pb.KvChunk(sequence_number=3, layer_start=1, layer_end=2, dtype="float32")
    header.runs.add(first_block_id=7, num_blocks=2)
    data = os.urandom(300)
    raw = encode_chunk_message(header, memoryview(data))
    whole = pb.KvChunk()
    whole.CopyFrom(header)
    whole.data = data
    assert pb.KvPushMessage.FromString(raw) == pb.KvPushMessage(chunk=whole)
    for wire in (raw, pb.KvPushMessage(chunk=whole).SerializeToString()):
        message, view = split_push_message(wire)
        assert (message, bytes(view)) == (pb.KvPushMessage(chunk=header), data)
    twice = raw + pb.KvPushMessage(chunk=pb.KvChunk(is_last=True)).SerializeToString()
    message, view = split_push_message(twice)  # protobuf merges a repeated chunk field
    assert message.chunk.is_last and message.chunk.sequence_number == 3 and bytes(view) == data
    with pytest.raises(ValueError, match="not a KvPushMessage"):
        split_push_message(raw[:-1])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
async def test_loopback_copies_blocks(dtype: torch.dtype) -> None:
    layout = layout_for(dtype)
    receiver = KvReceiver()
    dst = make_pools(layout, DST_SEED)
    by_name = {"target": dst[KvPool.TARGET], "draft": dst[KvPool.DRAFT]}  # as LLMEngine.kv_pools
    receiver.reserve(KvReservation("r1", DST_IDS, by_name, layout))
    src = make_pools(layout, SRC_SEED)
    sender = LoopbackTransport(receiver).sender()
    await push_all(sender, "r1", layout, src)
    extra = await receiver.wait_done("r1", timeout=1)
    assert sender.state is TransferState.DONE
    assert mismatches(dst, src, make_pools(layout, DST_SEED)) == []
    assert torch.equal(extra["hidden_states"], extra_tensors(dtype)["hidden_states"])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("transport", ["grpc", "shm"])
@pytest.mark.parametrize("options", [SMALL_CHUNKS, GROUPED_LAYERS], ids=["split", "grouped"])
async def test_push_copies_blocks_bit_for_bit(
    receiving: Receiving, dtype: torch.dtype, transport: str, options: TransferOptions
) -> None:
    layout = layout_for(dtype)
    dst = receiving.reserve("r1", layout)
    src = make_pools(layout, SRC_SEED)
    rings = ShmRingPool.for_options(options)
    sender = make_sender(
        receiving.channel,
        peer_host_id=host_id() if transport == "shm" else "another-host",
        rings=rings,
        options=options,
    )
    assert isinstance(sender.channel, ShmChannel) == (transport == "shm")
    await push_all(sender, "r1", layout, src)
    extra = await receiving.receiver.wait_done("r1", timeout=5)
    rings.close()
    assert sender.state is TransferState.DONE
    # split: each layer in several chunks; grouped: one chunk per pool
    assert (sender.num_chunks_sent > 4) == (options is SMALL_CHUNKS)
    assert mismatches(dst, src, make_pools(layout, DST_SEED)) == []
    for name, want in extra_tensors(dtype).items():
        assert extra[name].dtype == want.dtype
        assert torch.equal(extra[name], want)


async def test_shm_and_grpc_give_the_same_pools(receiving: Receiving, rings: ShmRingPool) -> None:
    layout = layout_for(torch.bfloat16)
    src = make_pools(layout, SRC_SEED)
    results = {}
    for request_id, sender in [
        ("via-grpc", grpc_sender(receiving.channel, TransferOptions())),
        ("via-shm", shm_sender(receiving.channel, rings, SMALL_CHUNKS)),
    ]:
        results[request_id] = receiving.reserve(request_id, layout)
        await push_all(sender, request_id, layout, src)
        await receiving.receiver.wait_done(request_id, timeout=5)
    for pool in KvPool:
        for a, b in zip(
            results["via-grpc"][pool].layers,
            results["via-shm"][pool].layers,
            strict=True,
        ):
            assert all(
                torch.equal(x.view(torch.int16), y.view(torch.int16))
                for x, y in zip(a, b, strict=True)
            )


@pytest.mark.parametrize("transport", ["grpc", "shm"])
async def test_corrupted_chunk_is_refused(
    receiving: Receiving, rings: ShmRingPool, transport: str
) -> None:
    layout = layout_for(torch.float32)
    receiving.reserve("r1", layout)

    def flip_a_byte(sequence_number: int, data: torch.Tensor) -> None:
        if sequence_number == 1:
            data[17] ^= 0x40

    if transport == "shm":
        sender = shm_sender(receiving.channel, rings, SMALL_CHUNKS, tamper=flip_a_byte)
    else:
        sender = grpc_sender(receiving.channel, SMALL_CHUNKS, tamper=flip_a_byte)
    with pytest.raises(KvTransferError) as refused:
        await push_all(sender, "r1", layout, make_pools(layout, SRC_SEED))
    assert refused.value.status == pb.KV_PUSH_STATUS_CHECKSUM_MISMATCH
    assert sender.state is TransferState.FAILED
    assert receiving.receiver.state("r1") is TransferState.FAILED
    assert "chunk 1: checksum" in receiving.receiver.failure("r1")
    with pytest.raises(KvTransferError, match="CHECKSUM_MISMATCH"):
        await receiving.receiver.wait_done("r1", timeout=1)


async def test_fingerprint_mismatch_is_refused_at_handshake(receiving: Receiving) -> None:
    dst = receiving.reserve("r1", layout_for(torch.float32, draft_fingerprint="eagle3-abc"))
    theirs = layout_for(torch.float32, draft_fingerprint="eagle3-OLD")
    sender = grpc_sender(receiving.channel, SMALL_CHUNKS)
    with pytest.raises(KvTransferError) as refused:
        await push_all(sender, "r1", theirs, make_pools(theirs, SRC_SEED))
    assert refused.value.status == pb.KV_PUSH_STATUS_INCOMPATIBLE
    assert refused.value.message == (
        "draft_fingerprint: sender has 'eagle3-OLD', receiver expects 'eagle3-abc'"
    )
    assert receiving.receiver.state("r1") is TransferState.FAILED
    assert mismatches(dst, dst, make_pools(theirs, DST_SEED), [], []) == []


async def test_block_outside_the_reservation_is_refused(receiving: Receiving) -> None:
    layout = layout_for(torch.float32)
    receiving.reserve("r1", layout)
    sender = grpc_sender(receiving.channel, SMALL_CHUNKS)
    with pytest.raises(KvTransferError, match="block 15 is outside the reservation"):
        await push_all(sender, "r1", layout, make_pools(layout, SRC_SEED), [1, 2], [DST_IDS[0], 15])
    assert receiving.receiver.state("r1") is TransferState.FAILED


async def test_unknown_request_and_stale_epoch_are_refused(receiving: Receiving) -> None:
    layout = layout_for(torch.float32)
    with pytest.raises(KvTransferError, match="UNKNOWN_REQUEST"):
        await push_all(grpc_sender(receiving.channel), "nobody", layout, make_pools(layout, 1))
    receiving.receiver.epoch = 7
    receiving.reserve("r1", layout)
    with pytest.raises(KvTransferError, match="STALE_EPOCH: decode_epoch: sender has 0"):
        await push_all(grpc_sender(receiving.channel), "r1", layout, make_pools(layout, 1))
    # An earlier attempt's push (an older epoch than the reservation's) fails nothing.
    assert receiving.receiver.state("r1") is TransferState.RESERVED
    receiving.receiver.epoch = 8  # registered again: r1's own epoch, 7, is stale now
    with pytest.raises(KvTransferError, match="STALE_EPOCH: decode_epoch: sender has 7"):
        await push_all(
            grpc_sender(receiving.channel), "r1", layout, make_pools(layout, 1), decode_epoch=7
        )
    assert receiving.receiver.state("r1") is TransferState.FAILED  # no push can fill it now


async def _until_transferring(receiver: KvReceiver, request_id: str) -> None:
    for _ in range(500):
        if receiver.state(request_id) is TransferState.TRANSFERRING:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{request_id}: the receiver never took the handshake")


async def test_abort_fails_the_request(receiving: Receiving) -> None:
    layout = layout_for(torch.float32)
    receiving.reserve("r1", layout)
    src = make_pools(layout, SRC_SEED)
    sender = grpc_sender(receiving.channel, SMALL_CHUNKS)
    await sender.begin(Handshake("r1", layout))
    await sender.send_layer(KvPool.TARGET, 0, src[KvPool.TARGET].layers[0], SRC_IDS, DST_IDS)
    await _until_transferring(receiving.receiver, "r1")  # else the receiver never heard of it
    await sender.abort("prefill cancelled")
    assert sender.state is TransferState.FAILED
    with pytest.raises(KvTransferError, match="INCOMPLETE"):
        await receiving.receiver.wait_done("r1", timeout=5)


async def test_release_stops_a_running_push(receiving: Receiving) -> None:
    layout = layout_for(torch.float32)
    receiving.reserve("r1", layout)
    src = make_pools(layout, SRC_SEED)
    sender = grpc_sender(receiving.channel, SMALL_CHUNKS)
    await sender.begin(Handshake("r1", layout))
    await sender.send_layer(KvPool.TARGET, 0, src[KvPool.TARGET].layers[0], SRC_IDS, DST_IDS)
    await _until_transferring(receiving.receiver, "r1")
    receiving.receiver.drop("r1")
    with pytest.raises(KvTransferError, match="UNKNOWN_REQUEST: the reservation was dropped"):
        for layer in range(1, 3):
            await sender.send_layer(
                KvPool.TARGET, layer, src[KvPool.TARGET].layers[layer], SRC_IDS, DST_IDS
            )
        await sender.finish()


def _chunks(layout: KvLayout, pools: dict[KvPool, PagedKVCache]) -> list[pb.KvPushMessage]:
    """A valid push, message by message (one chunk per pool layer, block runs as is)."""
    import zlib

    messages = [pb.KvPushMessage(handshake=layout.to_handshake("r1", 0, pb.CHECKSUM_KIND_CRC32))]
    runs = merge_runs(SRC_IDS, DST_IDS)
    for pool in KvPool:
        for layer, kv in enumerate(pools[pool].layers):
            data = b"".join(
                t[r.src_start : r.src_start + r.num_blocks].numpy().tobytes()
                for r in runs
                for t in kv
            )
            chunk = pb.KvChunk(
                sequence_number=len(messages) - 1,
                layer_start=layer,
                layer_end=layer + 1,
                pool=pb.KV_POOL_TARGET if pool is KvPool.TARGET else pb.KV_POOL_DRAFT,
                dtype="float32",
                data=data,
                checksum=zlib.crc32(data),
            )
            chunk.runs.extend(
                pb.BlockRun(first_block_id=r.dst_start, num_blocks=r.num_blocks) for r in runs
            )
            messages.append(pb.KvPushMessage(chunk=chunk))
    messages.append(
        pb.KvPushMessage(chunk=pb.KvChunk(sequence_number=len(messages) - 1, is_last=True))
    )
    return messages


async def _stream(messages: list[pb.KvPushMessage]) -> AsyncIterator[bytes]:
    for m in messages:
        yield m.SerializeToString()


@pytest.mark.parametrize(
    ("edit", "status", "words"),
    [
        (lambda m: m, pb.KV_PUSH_STATUS_OK, ""),
        (lambda m: m[:2] + m[1:], pb.KV_PUSH_STATUS_OUT_OF_ORDER, "repeat, got 0, expected 1"),
        (lambda m: m[:2] + m[3:], pb.KV_PUSH_STATUS_OUT_OF_ORDER, "gap, got 2, expected 1"),
        (lambda m: m[:-1], pb.KV_PUSH_STATUS_INCOMPLETE, "before a message with is_last"),
        (lambda m: m[1:], pb.KV_PUSH_STATUS_OUT_OF_ORDER, "a chunk before the handshake"),
    ],
    ids=["valid", "duplicate", "missing", "no-last", "no-handshake"],
)
async def test_sequence_is_checked(edit, status: int, words: str) -> None:
    layout = layout_for(torch.float32)
    receiver = KvReceiver()
    receiver.reserve(KvReservation("r1", DST_IDS, make_pools(layout, DST_SEED), layout))
    reply = await receiver.receive(_stream(edit(_chunks(layout, make_pools(layout, SRC_SEED)))))
    assert (reply.status, words in reply.message) == (status, True), reply.message


async def test_a_missing_layer_fails_the_request() -> None:
    layout = layout_for(torch.float32)
    receiver = KvReceiver()
    receiver.reserve(KvReservation("r1", DST_IDS, make_pools(layout, DST_SEED), layout))
    messages = _chunks(layout, make_pools(layout, SRC_SEED))
    del messages[2]  # target layer 1
    for i, m in enumerate(messages[1:]):
        m.chunk.sequence_number = i
    reply = await receiver.receive(_stream(messages))
    assert reply.status == pb.KV_PUSH_STATUS_INCOMPLETE
    assert reply.message == "target layer 1 block 10 never arrived"
    with pytest.raises(KvTransferError, match="never arrived"):
        await receiver.wait_done("r1", timeout=1)


RECEIVER_PROCESS = """
import asyncio, json, sys
import grpc, torch
from kv_transfer import (
    KvReceiver, KvReservation, KvTransferError, ShmAttacher, add_kv_transfer_servicer,
    host_id, server_options,
)
from tests.kv_transfer.kv_pools import (
    DST_IDS, DST_SEED, SRC_SEED, layout_for, make_pools, mismatches,
)

async def main():
    torch.set_num_threads(1)
    layout = layout_for(torch.bfloat16)
    receiver = KvReceiver(attach_segment=ShmAttacher())
    server = grpc.aio.server(options=server_options())
    add_kv_transfer_servicer(server, receiver)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    pools = {}
    for request_id in sys.argv[1:]:
        pools[request_id] = make_pools(layout, DST_SEED)
        receiver.reserve(KvReservation(request_id, DST_IDS, pools[request_id], layout))
    print(json.dumps({"port": port, "host_id": host_id()}), flush=True)
    src, before = make_pools(layout, SRC_SEED), make_pools(layout, DST_SEED)
    for request_id in sys.argv[1:]:
        try:
            await receiver.wait_done(request_id, timeout=15)
            wrong = mismatches(pools[request_id], src, before)
            print(json.dumps({"request_id": request_id, "wrong": wrong}), flush=True)
        except KvTransferError as e:
            print(json.dumps({"request_id": request_id, "error": str(e)}), flush=True)
    await server.stop(0.5)

asyncio.run(main())
"""


async def test_two_processes_over_grpc_and_shm() -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_WAIT_POLICY": "PASSIVE"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", RECEIVER_PROCESS, "via-grpc", "via-shm",
        cwd=REPO, env=env, stdout=subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdout is not None
    try:
        hello = json.loads(await asyncio.wait_for(proc.stdout.readline(), 30))
        layout = layout_for(torch.bfloat16)
        src = make_pools(layout, SRC_SEED)
        rings = ShmRingPool.for_options(SMALL_CHUNKS)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{hello['port']}") as channel:
            for request_id, peer in [("via-grpc", "another-host"), ("via-shm", hello["host_id"])]:
                sender = make_sender(channel, peer_host_id=peer, rings=rings, options=SMALL_CHUNKS)
                assert isinstance(sender.channel, ShmChannel) == (request_id == "via-shm")
                await push_all(sender, request_id, layout, src)
        rings.close()
        results = [json.loads(await asyncio.wait_for(proc.stdout.readline(), 30)) for _ in "ab"]
        assert results == [
            {"request_id": "via-grpc", "wrong": []},
            {"request_id": "via-shm", "wrong": []},
        ]
        assert await asyncio.wait_for(proc.wait(), 10) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()

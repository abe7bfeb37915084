"""Same-host pushes into shared pools: each block written once, straight into its reserved
destination block; the reservation bounds what a sender writes, and a checksum over the
destination is checked before the request is admitted. Blocks released or refused while a
sender may be writing them wait until it provably stopped (its half-close, or a grace
period after its call ended), whether it lives in this process or another."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from engine.kv_cache import PagedKVCache
from kv_transfer import (
    ChunkedKvSender,
    Handshake,
    KvPool,
    KvReceiver,
    KvReservation,
    KvTransferError,
    SharedKvPools,
    ShmAttacher,
    ShmRingPool,
    TransferOptions,
    TransferState,
    add_kv_transfer_servicer,
    server_options,
    shm_channel,
    shm_sender,
)
from kv_transfer.checksum import checksum_kind
from kv_transfer.cuda_ipc import IpcHandle
from kv_transfer.receiver import ChunkSource
from kv_transfer.shm_channel import make_sender
from kv_transfer.shm_transport import host_id
from tandem.v1 import kv_transfer_pb2 as pb
from tests.kv_transfer.kv_pools import (
    DST_IDS,
    DST_SEED,
    SRC_IDS,
    SRC_SEED,
    bits,
    extra_tensors,
    layout_for,
    make_pools,
    mismatches,
    push_all,
)

SMALL_CHUNKS = TransferOptions(chunk_bytes=1024, window=2, timeout_s=10)
LAYOUT = layout_for(torch.float32)
REPO = Path(__file__).resolve().parents[2]


class SharedReceiving:
    """A receiver whose pools live in a shared segment, behind a grpc.aio server."""

    def __init__(self, *, write_grace_s: float = 1.0, fence_timeout_s: float = 30.0) -> None:
        self.pools = make_pools(LAYOUT, DST_SEED)
        self.shared = SharedKvPools.adopt(LAYOUT, {p.value: c for p, c in self.pools.items()})
        assert self.shared is not None
        self.rings_seen: list[pb.ShmSegment] = []
        attacher = ShmAttacher()

        def attach(segment: pb.ShmSegment) -> ChunkSource:
            self.rings_seen.append(segment)
            return attacher(segment)

        self.receiver = KvReceiver(
            attach_segment=attach,
            shared_pools=self.shared,
            write_grace_s=write_grace_s,
            fence_timeout_s=fence_timeout_s,
        )
        self.server = grpc.aio.server(options=server_options())
        add_kv_transfer_servicer(self.server, self.receiver)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{self.port}")
        self.rings = ShmRingPool.for_options(SMALL_CHUNKS)

    def reserve(self, request_id: str, block_ids: tuple[int, ...] = DST_IDS) -> None:
        self.receiver.reserve(KvReservation(request_id, block_ids, self.pools, LAYOUT))


@pytest.fixture
async def shared(request: pytest.FixtureRequest) -> AsyncIterator[SharedReceiving]:
    """Parametrize indirectly with SharedReceiving's keyword arguments."""
    r = SharedReceiving(**getattr(request, "param", {}))
    await r.server.start()
    yield r
    await r.channel.close()
    await r.server.stop(0)
    r.rings.close()
    r.shared.close()


def test_pools_move_into_the_segment_with_their_contents() -> None:
    pools = make_pools(LAYOUT, DST_SEED)
    k = pools[KvPool.TARGET].layers[1][0]
    shared = SharedKvPools.adopt(LAYOUT, {p.value: c for p, c in pools.items()})
    assert shared is not None
    assert pools[KvPool.TARGET].layers[1][0] is k  # the engine's tensors, moved in place
    assert k.data_ptr() == shared.layer(KvPool.TARGET, 1)[0].data_ptr()
    assert mismatches(pools, pools, make_pools(LAYOUT, DST_SEED), [], []) == []
    assert shared.holds(KvPool.DRAFT, pools[KvPool.DRAFT].layers)
    assert not shared.holds(KvPool.TARGET, make_pools(LAYOUT, DST_SEED)[KvPool.TARGET].layers)
    assert shared.is_open()
    shared.close()
    assert not shared.is_open()


def test_pools_shared_with_other_ranks_stay_where_they_are() -> None:
    """A split engine's pools are views its ranks map (engine.executor.shared_kv), and
    pools captured in CUDA graphs are pinned: they are not moved, and same-host senders
    use the ring."""
    pools = make_pools(LAYOUT, DST_SEED)
    target = pools[KvPool.TARGET]
    pools[KvPool.TARGET] = PagedKVCache(
        target.params, target.num_blocks, torch.device("cpu"), target.layers
    )
    assert SharedKvPools.adopt(LAYOUT, {p.value: c for p, c in pools.items()}) is None
    with pytest.raises(ValueError, match="shared with other ranks"):
        pools[KvPool.TARGET].place(lambda shape, dtype: torch.empty(shape, dtype=dtype))
    pinned = make_pools(LAYOUT, DST_SEED)  # as captured CUDA graphs pin them
    pinned[KvPool.DRAFT].pin()
    assert SharedKvPools.adopt(LAYOUT, {p.value: c for p, c in pinned.items()}) is None


SUM64 = TransferOptions(checksum="sum64")  # what a GPU push uses, checked here on CPU


@pytest.mark.parametrize(
    "options", [SMALL_CHUNKS, TransferOptions(), SUM64], ids=["split", "grouped", "sum64"]
)
async def test_blocks_are_written_once_in_place(
    shared: SharedReceiving, options: TransferOptions
) -> None:
    shared.reserve("r1")
    src = make_pools(LAYOUT, SRC_SEED)
    rings = ShmRingPool.for_options(options)
    sender = shm_sender(shared.channel, rings, options)
    await push_all(sender, "r1", LAYOUT, src)
    rings.close()
    extra = await shared.receiver.wait_done("r1", timeout=5)
    assert sender.state is TransferState.DONE
    assert sender.is_placed
    assert shared.rings_seen == []  # no ring was mapped: the blocks went in place
    assert mismatches(shared.pools, src, make_pools(LAYOUT, DST_SEED)) == []
    assert torch.equal(extra["hidden_states"], extra_tensors(LAYOUT.dtype)["hidden_states"])
    assert sender.num_bytes_sent == sum(
        LAYOUT.block_bytes(p) * len(DST_IDS) * s.num_layers
        for p in KvPool
        if (s := LAYOUT.pool_shape(p)) is not None
    )


async def test_a_sender_cannot_write_outside_its_reservation(shared: SharedReceiving) -> None:
    shared.reserve("r1")
    outside = 15
    assert outside not in DST_IDS
    before = bits(shared.pools[KvPool.TARGET].layers[0][0][outside]).clone()
    sender = shm_sender(shared.channel, shared.rings, SMALL_CHUNKS)
    src = make_pools(LAYOUT, SRC_SEED)
    with pytest.raises(KvTransferError, match=f"block {outside} is outside the reservation"):
        await push_all(sender, "r1", LAYOUT, src, [1, 2], [DST_IDS[0], outside])
    assert sender.state is TransferState.FAILED
    assert torch.equal(bits(shared.pools[KvPool.TARGET].layers[0][0][outside]), before)
    with pytest.raises(KvTransferError, match="INCOMPLETE"):
        await shared.receiver.wait_done("r1", timeout=5)
    assert shared.receiver.drop("r1") is None  # it stopped with a half-close


@pytest.mark.parametrize("checksum", ["auto", "sum64"])
async def test_a_corrupted_block_is_refused_and_the_request_not_admitted(
    shared: SharedReceiving, checksum: str
) -> None:
    shared.reserve("r1")

    def flip_a_byte(sequence_number: int, data: torch.Tensor) -> None:
        if sequence_number == 1:
            data[17] ^= 0x40  # in the receiver's pool, after the checksum was taken

    options = dataclasses.replace(SMALL_CHUNKS, checksum=checksum)
    sender = shm_sender(shared.channel, shared.rings, options, tamper=flip_a_byte)
    with pytest.raises(KvTransferError) as refused:
        await push_all(sender, "r1", LAYOUT, make_pools(LAYOUT, SRC_SEED))
    assert refused.value.status == pb.KV_PUSH_STATUS_CHECKSUM_MISMATCH
    assert sender.is_placed
    assert shared.receiver.state("r1") is TransferState.FAILED
    assert "chunk 1: checksum" in shared.receiver.failure("r1")
    with pytest.raises(KvTransferError, match="CHECKSUM_MISMATCH"):
        await shared.receiver.wait_done("r1", timeout=1)
    # the sender learnt it from the reply to its half-close: nothing writes the blocks now
    assert shared.receiver.drop("r1") is None


async def test_gpu_pools_are_offered_to_sum64_pushes_that_see_their_gpu(
    shared: SharedReceiving, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The negotiation of a CUDA IPC push, on CPU: pools announced with a GPU handle are
    offered only to a push checksummed with SUM64 by a sender that names their GPU; the
    others get the ring (an XXH3 push; a SUM64 push from a process that sees no GPU). The
    one offered them is answered "cuda_ipc", which the sender reads as the GPU pools'
    handle and their fences' segment: here a host segment, refused as INCOMPATIBLE."""
    bus = "0000:19:00.0"
    shared.shared.ipc = IpcHandle(bytes(64), bus.encode(), 0, 4096)  # as if on a GPU
    sum64 = dataclasses.replace(SMALL_CHUNKS, checksum="sum64")
    monkeypatch.setattr(shm_channel, "visible_bus_ids", lambda: ())  # a process without GPUs
    for i, options in enumerate((SMALL_CHUNKS, sum64)):
        shared.reserve(f"r{i}")
        sender = shm_sender(shared.channel, shared.rings, options)
        await push_all(sender, f"r{i}", LAYOUT, make_pools(LAYOUT, SRC_SEED))
        assert not sender.is_placed and len(shared.rings_seen) == i + 1
        await shared.receiver.wait_done(f"r{i}", timeout=5)
    monkeypatch.setattr(shm_channel, "visible_bus_ids", lambda: ["0000:3b:00.0", bus])
    shared.reserve("r2")
    sender = shm_sender(shared.channel, shared.rings, sum64)
    with pytest.raises(KvTransferError, match=r"INCOMPATIBLE: shm pools: size: .* fences"):
        await push_all(sender, "r2", LAYOUT, make_pools(LAYOUT, SRC_SEED))
    assert len(shared.rings_seen) == 2  # answered in place, not with a ring


async def test_a_sender_on_a_gpu_checksums_with_sum64_for_pools_on_a_gpu_it_sees_alone(
    shared: SharedReceiving, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SUM64 only where the receiver's pools may take the push in place: on this host, on
    a GPU this process sees (the Reserve reply's kv_pools_bus_id); else XXH3 ("auto")."""
    bus = "0000:19:00.0"
    monkeypatch.setattr(shm_channel, "visible_bus_ids", lambda: ["0000:3b:00.0", bus])

    def sender(host: str, on_gpu: bool, pools_bus_id: str = bus) -> ChunkedKvSender:
        return make_sender(shared.channel, peer_host_id=host, rings=shared.rings,
                           options=SMALL_CHUNKS, pools_on_gpu=on_gpu,
                           peer_pools_bus_id=pools_bus_id)  # fmt: skip

    assert sender(host_id(), True).checksum_kind == pb.CHECKSUM_KIND_SUM64
    others = [
        sender("elsewhere", True),
        sender(host_id(), False),  # this worker's pools are on the host
        sender(host_id(), True, ""),  # the receiver's are not on a GPU (or IPC refused)
        sender(host_id(), True, "0000:5d:00.0"),  # on a GPU this process does not see
    ]
    assert [s.checksum_kind for s in others] == [checksum_kind("auto")] * 4


async def test_pools_not_in_the_segment_go_through_the_ring(shared: SharedReceiving) -> None:
    private = make_pools(LAYOUT, DST_SEED)
    shared.receiver.reserve(KvReservation("r1", DST_IDS, private, LAYOUT))
    src = make_pools(LAYOUT, SRC_SEED)
    sender = shm_sender(shared.channel, shared.rings, SMALL_CHUNKS)
    await push_all(sender, "r1", LAYOUT, src)
    await shared.receiver.wait_done("r1", timeout=5)
    assert not sender.is_placed
    assert len(shared.rings_seen) == 1
    assert mismatches(private, src, make_pools(LAYOUT, DST_SEED)) == []


async def _midway(shared: SharedReceiving) -> tuple[ChunkedKvSender, dict[KvPool, Any]]:
    """A same-host push into r1, paused after target layer 0 was written in place."""
    shared.reserve("r1")
    src = make_pools(LAYOUT, SRC_SEED)
    sender = shm_sender(shared.channel, shared.rings, SMALL_CHUNKS)
    await sender.begin(Handshake("r1", LAYOUT))
    await sender.send_layer(KvPool.TARGET, 0, src[KvPool.TARGET].layers[0], SRC_IDS, DST_IDS)
    assert sender.is_placed
    return sender, src


def _fenced(shared: SharedReceiving) -> list[int]:
    return [b for b in DST_IDS if shared.shared.is_fenced(b, 1)]


@pytest.mark.parametrize("shared", [{"write_grace_s": 60.0}], indirect=True)
async def test_blocks_released_mid_push_wait_for_the_sender_to_stop(
    shared: SharedReceiving,
) -> None:
    sender, src = await _midway(shared)
    stopping = shared.receiver.drop("r1")
    assert stopping is not None and _fenced(shared) == list(DST_IDS)
    await asyncio.sleep(0.3)  # the sender is paused between chunks: it has not stopped
    assert not stopping.done()
    k1 = shared.pools[KvPool.TARGET].layers[1][0]
    before = bits(k1).clone()
    with pytest.raises(KvTransferError, match="UNKNOWN_REQUEST: the reservation was dropped"):
        await sender.send_layer(KvPool.TARGET, 1, src[KvPool.TARGET].layers[1], SRC_IDS, DST_IDS)
    assert torch.equal(bits(k1), before)  # the fence stopped it before it wrote
    assert sender.state is TransferState.FAILED
    await asyncio.wait_for(stopping, 5)  # its half-close, well before the 60 s grace
    assert _fenced(shared) == []
    assert shared.receiver.drop("r1") is None


async def test_releases_with_no_push_writing_in_place_free_at_once(
    shared: SharedReceiving,
) -> None:
    shared.reserve("idle")
    assert shared.receiver.drop("idle") is None
    private = make_pools(LAYOUT, DST_SEED)  # not in the segment: the push goes by the ring
    shared.receiver.reserve(KvReservation("ring", DST_IDS, private, LAYOUT))
    src = make_pools(LAYOUT, SRC_SEED)
    sender = shm_sender(shared.channel, shared.rings, SMALL_CHUNKS)
    await sender.begin(Handshake("ring", LAYOUT))
    await sender.send_layer(KvPool.TARGET, 0, src[KvPool.TARGET].layers[0], SRC_IDS, DST_IDS)
    assert not sender.is_placed
    assert shared.receiver.drop("ring") is None  # the receiver writes ring chunks itself
    shared.reserve("done")
    await push_all(shm_sender(shared.channel, shared.rings, SMALL_CHUNKS), "done", LAYOUT, src)
    await shared.receiver.wait_done("done", timeout=5)
    assert shared.receiver.drop("done") is None  # written, all of it, before is_last
    assert _fenced(shared) == []


@pytest.mark.parametrize("shared", [{"write_grace_s": 1.0}], indirect=True)
async def test_a_call_ended_without_a_half_close_keeps_the_blocks_a_grace_period(
    shared: SharedReceiving,
) -> None:
    sender, _ = await _midway(shared)
    sender.channel.stream.cancel()  # type: ignore[attr-defined]  # as a deadline would
    with pytest.raises(KvTransferError, match="cancelled or broke"):
        await shared.receiver.wait_done("r1", timeout=5)
    loop = asyncio.get_running_loop()
    start = loop.time()
    stopping = shared.receiver.drop("r1")
    assert stopping is not None  # a copy under way may still land
    await asyncio.wait_for(stopping, 5)
    assert loop.time() - start > 0.5
    assert _fenced(shared) == []


@pytest.mark.parametrize("shared", [{"fence_timeout_s": 0.3, "write_grace_s": 0.3}], indirect=True)
async def test_a_fenced_sender_that_never_stops_is_cut_off(shared: SharedReceiving) -> None:
    sender, src = await _midway(shared)
    stopping = shared.receiver.drop("r1")
    assert stopping is not None
    await asyncio.wait_for(stopping, 5)  # the call ended after 0.3 s, then the grace
    k1 = shared.pools[KvPool.TARGET].layers[1][0]
    before = bits(k1).clone()
    with pytest.raises(KvTransferError, match="the reservation was dropped"):
        await sender.send_layer(KvPool.TARGET, 1, src[KvPool.TARGET].layers[1], SRC_IDS, DST_IDS)
    assert torch.equal(bits(k1), before)  # it saw the call's end before writing


SENDER_PROCESS = """
import asyncio, sys
import grpc, torch
from kv_transfer import Handshake, KvPool, KvTransferError, ShmRingPool, TransferOptions, shm_sender
from tests.kv_transfer.kv_pools import DST_IDS, SRC_IDS, SRC_SEED, layout_for, make_pools

async def main():
    torch.set_num_threads(1)
    layout = layout_for(torch.float32)
    layers = make_pools(layout, SRC_SEED)[KvPool.TARGET].layers
    options = TransferOptions(chunk_bytes=1024, window=2, timeout_s=60)
    rings = ShmRingPool.for_options(options)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{sys.argv[1]}") as channel:
        sender = shm_sender(channel, rings, options)
        await sender.begin(Handshake("r1", layout))
        await sender.send_layer(KvPool.TARGET, 0, layers[0], SRC_IDS, DST_IDS)
        print("placed" if sender.is_placed else "ring", flush=True)
        await asyncio.to_thread(sys.stdin.readline)  # paused mid-push until told to go on
        try:
            await sender.send_layer(KvPool.TARGET, 1, layers[1], SRC_IDS, DST_IDS)
            print("sent", flush=True)
        except KvTransferError as e:
            print(e, flush=True)
    rings.close()

asyncio.run(main())
"""


@pytest.mark.parametrize(
    ("end", "shared"),
    [("resumed", {"write_grace_s": 60.0}), ("killed", {"write_grace_s": 0.5})],
    indirect=["shared"],
)
async def test_a_sender_process_paused_mid_push(shared: SharedReceiving, end: str) -> None:
    """Resumed, it meets the fence and half-closes: the blocks are free at once. Killed
    (SIGKILL), its connection breaks: they are free after the grace period."""
    shared.reserve("r1")
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_WAIT_POLICY": "PASSIVE"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", SENDER_PROCESS, str(shared.port),
        cwd=REPO, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdin is not None and proc.stdout is not None
    try:
        assert await asyncio.wait_for(proc.stdout.readline(), 30) == b"placed\n"
        stopping = shared.receiver.drop("r1")
        assert stopping is not None
        await asyncio.sleep(0.5)  # alive and paused: the blocks stay its
        assert not stopping.done()
        if end == "killed":
            proc.kill()
            await proc.wait()
        else:
            proc.stdin.write(b"go\n")
            await proc.stdin.drain()
            said = await asyncio.wait_for(proc.stdout.readline(), 30)
            assert said.endswith(b"UNKNOWN_REQUEST: the reservation was dropped\n"), said
        await asyncio.wait_for(stopping, 10)
        assert _fenced(shared) == []
        if end == "resumed":
            assert await asyncio.wait_for(proc.wait(), 10) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


# Makes a receiver's shared pools of about 256 MiB, touches them, says what it announces.
RECEIVER_PROCESS = """
import sys, torch
from kv_transfer import SharedKvPools
from tests.kv_transfer.kv_pools import layout_for
shared = SharedKvPools.create(layout_for(torch.float32), 131_072)
sys.stdout.write(shared.segment().SerializeToString().hex() + "\\n")
sys.stdout.flush()
sys.stdin.readline()
"""


def _rss_shmem_bytes(pid: int) -> int:
    """Shared memory resident in process ``pid`` (/proc/PID/status RssShmem)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssShmem:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no RssShmem line in /proc/{pid}/status")


def _shmem_bytes() -> int:
    """Shared memory in use on this machine (/proc/meminfo Shmem)."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("Shmem:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no Shmem line in /proc/meminfo")


def test_a_receiver_killed_with_sigkill_leaves_no_shared_memory_behind() -> None:
    """Its pools stay readable to a sender that mapped them, and their memory goes back to
    the machine with the last mapping: nothing has a name that outlives the processes.
    The machine-wide Shmem moves with other processes too (an earlier test's cluster
    exiting frees its pools), so the receiver's own share is read from its status, and
    the machine's is compared across the release only."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_WAIT_POLICY": "PASSIVE"}
    proc = subprocess.Popen(
        [sys.executable, "-c", RECEIVER_PROCESS],
        cwd=REPO, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        segment = pb.ShmSegment.FromString(bytes.fromhex(proc.stdout.readline()))
        assert segment.owner_pid == proc.pid and segment.size > 256 << 20
        assert _rss_shmem_bytes(proc.pid) > segment.size // 2  # pre-touched
        mapped = SharedKvPools.attach(segment, layout_for(torch.float32))
        k = mapped.layer(KvPool.TARGET, 2)[0]
        k[-1].fill_(3.0)
        proc.kill()
        proc.wait()
        assert not mapped.is_open()
        with pytest.raises(FileNotFoundError):
            SharedKvPools.attach(segment, layout_for(torch.float32))
        assert float(k[-1].sum()) == 3.0 * k[-1].numel()  # the mapping outlives its owner
        held = _shmem_bytes()
        del k, mapped
        gc.collect()
        assert held - _shmem_bytes() > segment.size // 2  # freed with the last mapping
    finally:
        proc.kill()
        proc.wait()

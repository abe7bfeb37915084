"""CUDA IPC for KV pools (kv_transfer/cuda_ipc.py): on CPU it refuses with a message that
says what runs instead, and its handle travels as exactly 96 bytes, its GPU named by PCI bus
id; on a GPU (``gpu``) a
spawned receiver's pool, opened here through its handle, holds exactly what was copied in,
run by run, a slice is exported at its offset in its allocation, and a push from another
process into a decode worker's GPU pools goes in place through the KV channel."""

from __future__ import annotations

import pytest
import torch

from kv_transfer.cuda_ipc import (
    CudaIpcUnavailable,
    IpcHandle,
    OpenedTensor,
    export,
    export_refusal,
    unavailable_reason,
)

needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA: IPC handles exist on a GPU only"
)


def test_a_handle_round_trips_as_bytes_and_a_cut_one_is_refused() -> None:
    handle = IpcHandle(bytes([0, 7] * 32), b"0000:19:00.0", offset=4096, num_bytes=1 << 30)
    data = handle.to_bytes()
    assert len(data) == 96
    assert IpcHandle.from_bytes(data) == handle  # NULs inside the handle kept
    with pytest.raises(ValueError, match="95 bytes, expected 96"):
        IpcHandle.from_bytes(data[:-1])
    with pytest.raises(ValueError, match="63 bytes, not 64"):
        IpcHandle(bytes(63), b"0000:19:00.0", 0, 16)
    with pytest.raises(ValueError, match="not a PCI bus id"):
        IpcHandle(bytes(64), b"", 0, 16)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is what a CPU machine sees")
def test_without_cuda_it_refuses_and_says_what_runs_instead() -> None:
    assert unavailable_reason() == (
        "no CUDA device: KV moves through the shared-memory channel on this machine"
    )
    with pytest.raises(CudaIpcUnavailable, match="on cpu, not a GPU"):
        export(torch.zeros(16))
    with pytest.raises(CudaIpcUnavailable, match="no CUDA device"):
        OpenedTensor(IpcHandle(bytes(64), b"0000:19:00.0", 0, 16))
    assert export_refusal(torch.device("cuda")) == f"CUDA IPC: {unavailable_reason()}"
    assert export_refusal(torch.device("cpu")) == "CUDA IPC: cpu is not a GPU"


@pytest.mark.gpu
@needs_cuda
def test_a_spawned_receivers_pool_holds_exactly_what_was_copied_through_its_handle() -> None:
    from bench.cuda_ipc import measure

    found = measure(num_bytes=64 << 20, run_bytes=4 << 20, repeats=3)
    assert found["received_equals_source"] is True
    assert found["ipc_gb_s"] > 0 and found["d2d_gb_s"] > 0


@pytest.mark.gpu
@needs_cuda
def test_a_slice_is_exported_at_its_offset_in_the_allocation() -> None:
    pool = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda")
    whole, tail = export(pool), export(pool[4096:])
    assert whole.handle == tail.handle and len(whole.handle) == 64
    assert whole.bus_id.count(b":") == 2  # e.g. 0000:19:00.0
    assert tail.offset - whole.offset == 4096
    assert (whole.num_bytes, tail.num_bytes) == (1 << 20, (1 << 20) - 4096)
    assert export_refusal(pool.device) is None  # what share_pools asks before moving pools


@pytest.mark.skipif(torch.cuda.is_available(), reason="the receiver fails only without CUDA")
def test_a_receiver_that_dies_ends_the_senders_wait_with_its_exit() -> None:
    """bench/cuda_ipc.py's pipe: a receiver that fails before sending (here: no CUDA, as
    a driver refusing IPC would) closes the only other end, so the sender learns at once
    instead of waiting for ever."""
    import multiprocessing

    from bench.cuda_ipc import next_message, receive

    spawn = multiprocessing.get_context("spawn")
    conn, child_conn = spawn.Pipe()
    receiver = spawn.Process(target=receive, args=(child_conn, 4096), daemon=True)
    receiver.start()
    child_conn.close()
    with pytest.raises(RuntimeError, match=r"the receiver ended \(exit 1\) before its handle"):
        next_message(conn, receiver, "handle", wait_s=120)


# A same-host prefill worker's part: its pools on the GPU, pushed with SUM64; says how.
CUDA_SENDER = """
import asyncio, sys
import grpc, torch
from engine.kv_cache import PagedKVCache
from kv_transfer import ShmRingPool, TransferOptions, shm_sender
from tests.kv_transfer.kv_pools import SRC_SEED, layout_for, make_pools, push_all

async def main():
    layout = layout_for(torch.float32)
    src = {}
    for pool, cache in make_pools(layout, SRC_SEED).items():
        layers = [tuple(t.cuda() for t in kv) for kv in cache.layers]
        src[pool] = PagedKVCache(cache.params, cache.num_blocks, torch.device("cuda"), layers)
    options = TransferOptions(chunk_bytes=1024, window=2, timeout_s=60, checksum="sum64")
    rings = ShmRingPool.for_options(options)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{sys.argv[1]}") as channel:
        sender = shm_sender(channel, rings, options)
        await push_all(sender, "r1", layout, src)
        print("placed" if sender.is_placed else "ring", sender.state.value, flush=True)
    rings.close()

asyncio.run(main())
"""


@pytest.mark.gpu
@needs_cuda
async def test_a_push_into_gpu_pools_goes_in_place_through_cuda_ipc() -> None:
    """A decode worker's pools on the GPU move into one exported allocation; a sender in
    another process (a process cannot open its own handle) is answered "cuda_ipc", copies
    each block device to device and checksums it there (SUM64), and the receiver checks
    the blocks where they lie: the pools then hold the sent blocks, bit for bit."""
    import asyncio
    import os
    import sys
    from pathlib import Path

    import grpc

    from engine.kv_cache import PagedKVCache
    from kv_transfer import (
        KvReceiver,
        KvReservation,
        SharedKvPools,
        ShmAttacher,
        add_kv_transfer_servicer,
        server_options,
    )
    from tests.kv_transfer.kv_pools import (
        DST_IDS,
        DST_SEED,
        SRC_SEED,
        layout_for,
        make_pools,
        mismatches,
    )

    layout = layout_for(torch.float32)
    pools = {}
    for pool, cache in make_pools(layout, DST_SEED).items():  # placeable: their own memory
        pools[pool] = PagedKVCache(cache.params, cache.num_blocks, torch.device("cuda"))
        for dst, src in zip(pools[pool].layers, cache.layers, strict=True):
            for d, s in zip(dst, src, strict=True):
                d.copy_(s)
    shared = SharedKvPools.adopt(layout, {p.value: c for p, c in pools.items()})
    assert shared is not None and shared.ipc is not None
    receiver = KvReceiver(attach_segment=ShmAttacher(), shared_pools=shared)
    server = grpc.aio.server(options=server_options())
    add_kv_transfer_servicer(server, receiver)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        receiver.reserve(KvReservation("r1", DST_IDS, pools, layout))
        repo = Path(__file__).resolve().parents[2]
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", CUDA_SENDER, str(port), cwd=repo,
            env={**os.environ, "PYTHONPATH": str(repo)}, stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        said, _ = await asyncio.wait_for(proc.communicate(), 120)
        assert said.decode().split() == ["placed", "done"], said
        await receiver.wait_done("r1", timeout=10)
        on_host = {}
        for pool, cache in pools.items():
            layers = [tuple(t.cpu() for t in kv) for kv in cache.layers]
            on_host[pool] = PagedKVCache(
                cache.params, cache.num_blocks, torch.device("cpu"), layers
            )
        assert mismatches(on_host, make_pools(layout, SRC_SEED), make_pools(layout, DST_SEED)) == []
    finally:
        await server.stop(0)
        shared.close()

"""The CUDA IPC KV channel against a device copy (issue 41): one KV push of a Llama-3-8B
prompt's blocks from this process's GPU pools into a spawned decode-side receiver's GPU
pools, through the channel as the workers run it, against copying the same blocks pool to
pool within this process.

The channel: the receiver's pools moved into one exported allocation
(``SharedKvPools`` on a CUDA device), a ``KvReceiver`` behind a gRPC server on loopback
answering the push with placement "cuda_ipc", and this process's ``shm_sender`` opening
the handle, copying each block device to device and checksumming it there (SUM64), the
receiver checking every chunk's blocks where they lie; only headers travel on the stream.
A push of ``--tokens`` tokens (2,048 by default: 128 blocks of 16, 32 layers of K and V
of 8 heads of 128 in bf16, 256 MiB) is timed from ``begin`` to the receiver's reply,
``--repeats`` times into the same blocks, after one warm-up push (the handle's opening,
kept per receiver). The local copy is each layer's K and V blocks into a second pool of
this process, synchronized before and after. Then the receiver's pools must hold exactly
this process's (a device checksum of every block).

    python bench/cuda_ipc_channel.py                 # on a GPU
    python bench/cuda_ipc_channel.py --tokens 512    # smaller

Without CUDA it says so and exits 2. The last line is one JSON object with
``cuda_ipc_over_d2d``: the push's bandwidth over the local copy's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import struct
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.cuda_ipc import WAIT_S, digest, next_message
from engine.kv_cache import KVCacheParams, PagedKVCache
from kv_transfer import (
    Handshake,
    KvLayout,
    KvPool,
    KvReceiver,
    KvReservation,
    PoolShape,
    SharedKvPools,
    ShmAttacher,
    ShmRingPool,
    TransferOptions,
    add_kv_transfer_servicer,
    server_options,
    shm_sender,
)
from kv_transfer.cuda_ipc import unavailable_reason

BLOCK_SIZE = 16
LAYOUT = KvLayout("llama-3-8b-shaped", torch.bfloat16, BLOCK_SIZE, PoolShape(32, 8, 128))
_INT = struct.Struct("<Q")


def gpu_pool(num_blocks: int, seed: int | None) -> PagedKVCache:
    """A target pool of ``LAYOUT`` on the GPU: zeros, or random from ``seed``."""
    shape = LAYOUT.target
    params = KVCacheParams(shape.num_layers, shape.num_kv_heads, shape.head_dim,
                           BLOCK_SIZE, LAYOUT.dtype, shape.num_tensors)  # fmt: skip
    pool = PagedKVCache(params, num_blocks, torch.device("cuda"))
    if seed is not None:
        generator = torch.Generator("cuda").manual_seed(seed)
        for kv in pool.layers:
            for t in kv:
                t.copy_(torch.randn(t.shape, device="cuda", generator=generator))
    return pool


def pool_digest(pool: PagedKVCache) -> int:
    """A device checksum of every block of every layer's K and V, in order."""
    tensors = (t for kv in pool.layers for t in kv)
    return sum(i * digest(t.reshape(-1).view(torch.uint8))
               for i, t in enumerate(tensors, 1)) % 2**64  # fmt: skip


def receive(conn: Connection, num_blocks: int, num_pushes: int) -> None:
    """The receiver process: GPU pools shared through CUDA IPC, a KvReceiver serving them,
    ``num_pushes`` reservations of the same blocks; then the pools' checksum."""
    asyncio.run(_serve(conn, num_blocks, num_pushes))


async def _serve(conn: Connection, num_blocks: int, num_pushes: int) -> None:
    import grpc

    pool = gpu_pool(num_blocks, None)
    shared = SharedKvPools.adopt(LAYOUT, {KvPool.TARGET.value: pool})
    if shared is None or shared.ipc is None:
        raise RuntimeError("the GPU pools could not be exported (see the log's warning)")
    receiver = KvReceiver(attach_segment=ShmAttacher(), shared_pools=shared)
    server = grpc.aio.server(options=server_options())
    add_kv_transfer_servicer(server, receiver)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    blocks = tuple(range(num_blocks))
    for i in range(num_pushes):
        receiver.reserve(KvReservation(f"r{i}", blocks, {KvPool.TARGET: pool}, LAYOUT))
    conn.send_bytes(_INT.pack(port))
    for i in range(num_pushes):
        await receiver.wait_done(f"r{i}", timeout=WAIT_S)
    torch.cuda.synchronize()
    conn.send_bytes(_INT.pack(pool_digest(pool)))
    await asyncio.to_thread(conn.recv_bytes)  # the sender is done with the pools
    await server.stop(0)
    shared.close()


async def push(port: int, source: PagedKVCache, request_id: str, rings: ShmRingPool) -> float:
    """Seconds for one push of every block of ``source``, begin to the receiver's reply."""
    import grpc

    options = TransferOptions(checksum="sum64", timeout_s=WAIT_S)
    blocks = list(range(source.num_blocks))
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        sender = shm_sender(channel, rings, options)
        started = time.perf_counter()
        await sender.begin(Handshake(request_id, LAYOUT))
        for layer, kv in enumerate(source.layers):
            await sender.send_layer(KvPool.TARGET, layer, kv, blocks, blocks)
        await sender.finish()
        seconds = time.perf_counter() - started
    if not sender.is_placed:
        raise RuntimeError("the receiver answered with the ring, not cuda_ipc")
    return seconds


def local_copy(dst: PagedKVCache, src: PagedKVCache) -> float:
    """Seconds to copy every layer's K and V blocks, synchronized before and after."""
    torch.cuda.synchronize()
    started = time.perf_counter()
    for dst_kv, src_kv in zip(dst.layers, src.layers, strict=True):
        for d, s in zip(dst_kv, src_kv, strict=True):
            d.copy_(s)
    torch.cuda.synchronize()
    return time.perf_counter() - started


def measure(num_tokens: int, repeats: int) -> dict[str, Any]:
    num_blocks = -(-num_tokens // BLOCK_SIZE)
    source, local = gpu_pool(num_blocks, 0), gpu_pool(num_blocks, None)
    num_bytes = num_blocks * LAYOUT.block_bytes(KvPool.TARGET) * LAYOUT.target.num_layers
    spawn = multiprocessing.get_context("spawn")
    conn, child_conn = spawn.Pipe()
    receiver = spawn.Process(target=receive, args=(child_conn, num_blocks, repeats + 1),
                             daemon=True)  # fmt: skip
    receiver.start()
    child_conn.close()  # only the receiver holds it now: its death ends our waits
    rings = ShmRingPool.for_options(TransferOptions())
    try:
        (port,) = _INT.unpack(next_message(conn, receiver, "port"))

        async def pushes() -> list[float]:
            return [await push(port, source, f"r{i}", rings) for i in range(repeats + 1)]

        channel = sorted(asyncio.run(pushes())[1:])  # the first opened the handle
        local_copy(local, source)  # warm-up
        d2d = sorted(local_copy(local, source) for _ in range(repeats))
        (received,) = _INT.unpack(next_message(conn, receiver, "checksum"))
        conn.send_bytes(b"done")
        receiver.join(timeout=60)
    finally:
        rings.close()
        if receiver.is_alive():
            receiver.kill()
    channel_s, d2d_s = channel[len(channel) // 2], d2d[len(d2d) // 2]
    return {
        "num_tokens": num_tokens,
        "num_bytes": num_bytes,
        "repeats": repeats,
        "channel_gb_s": round(num_bytes / channel_s / 1e9, 2),
        "d2d_gb_s": round(num_bytes / d2d_s / 1e9, 2),
        "cuda_ipc_over_d2d": round(d2d_s / channel_s, 4),
        "received_equals_source": received == pool_digest(source),
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=2048, help="the pushed prompt's tokens")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    reason = unavailable_reason()
    if reason is not None:
        print(f"cuda_ipc_channel: {reason}", file=sys.stderr)
        return 2
    if args.tokens < 1 or args.repeats < 1:
        parser.error("--tokens and --repeats must be at least 1")
    result = {"device": torch.cuda.get_device_name(0)}
    result.update(measure(args.tokens, args.repeats))
    print(json.dumps(result))
    return 0 if result["received_equals_source"] else 1


if __name__ == "__main__":
    sys.exit(main())

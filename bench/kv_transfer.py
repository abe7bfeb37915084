"""KV transfer throughput between two processes on this host, against raw baselines.

The receiver is a second process (this script with ``--serve``) holding paged pools, a
grpc.aio server with the KvTransfer servicer and a raw TCP socket. The sender pushes the
same KV (``--total-mib`` of a Llama-3-8B-shaped bf16 cache: 32 layers, 8 KV heads,
head_dim 128, block_size 16; 4 runs of consecutive blocks) four ways, interleaved:

- ``grpc``: ``grpc_sender``, checksummed chunks, begin .. receiver wrote every block
  (also printed, not a ratio's term: ``grpc_plain``, the same bytes as premade
  ``--chunk-mib`` messages to a servicer that drops them: gRPC's own ceiling here);
- ``raw_socket``: the same bytes as one ``sendall`` from a pre-touched buffer into
  ``recv_into`` a pre-touched buffer, until the receiver acknowledges;
- ``shm``: ``shm_sender`` into the receiver's pools, which live in a shared segment
  (``SharedKvPools``): each block copied once into its reserved destination block and
  checksummed, the chunk headers over gRPC, the receiver checksumming the blocks in place
  before it replies;
- ``shm_ring`` (printed, not a ratio's term): the same into pools that are not shared,
  through the shared-memory ring (chunks in slots, pipe wake-ups), the receiver copying out;
- ``memcpy``: one ``tensor.copy_`` of the same bytes into a pre-touched tensor.

Each figure is the best of ``--repeats`` after one warm-up; each process uses one torch
thread. The last line is one JSON object (GB/s are 1e9 bytes per second).

    python bench/kv_transfer.py              # 256 MiB per push, best of 3
    python bench/kv_transfer.py --quick      # 64 MiB per push
    python bench/kv_transfer.py --sweep      # chunk size x window for grpc and shm
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import grpc
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kv_transfer import (
    ChunkedKvSender,
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
    grpc_sender,
    server_options,
    shm_sender,
)
from kv_transfer.base import merge_runs
from kv_transfer.checksum import checksum_kind, kind_name

MiB = 1 << 20
SINK = "tandem.bench.Sink"
LAYOUT = KvLayout("bench", torch.bfloat16, 16, PoolShape(32, 8, 128))
NUM_RUNS = 4


class Pools:
    """A target pool with ``num_blocks`` blocks per layer (duck-types PagedKVCache)."""

    def __init__(self, num_blocks: int, fill: bool, shared: SharedKvPools | None = None) -> None:
        shape = (num_blocks, LAYOUT.block_size, LAYOUT.target.num_kv_heads, LAYOUT.target.head_dim)
        self.layers = []
        for layer in range(LAYOUT.target.num_layers):
            kv = (torch.zeros(shape, dtype=LAYOUT.dtype), torch.zeros(shape, dtype=LAYOUT.dtype))
            if shared is not None:
                kv = shared.layer(KvPool.TARGET, layer)
            if fill:
                for t in kv:
                    t.view(torch.int16).random_(-(2**14), 2**14)
            self.layers.append(kv)


def block_ids(total_bytes: int) -> tuple[list[int], list[int], int]:
    """Source ids 0..n-1; destination ids in NUM_RUNS runs, in reverse order of runs."""
    per_block = LAYOUT.block_bytes(KvPool.TARGET) * LAYOUT.target.num_layers
    n = max(NUM_RUNS, total_bytes // per_block)
    run = n // NUM_RUNS
    dst = [b for r in reversed(range(NUM_RUNS)) for b in range(r * (run + 1), r * (run + 1) + run)]
    dst += list(range(NUM_RUNS * (run + 1), NUM_RUNS * (run + 1) + n - len(dst)))
    return list(range(n)), dst, max(dst) + 1


# ---------------------------------------------------------------- receiver process


def _raw_server(listener: socket.socket, buffer: bytearray) -> None:
    conn, _ = listener.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    view = memoryview(buffer)
    while header := conn.recv(8, socket.MSG_WAITALL):
        (n,) = struct.unpack("<Q", header)
        got = 0
        while got < n:
            got += conn.recv_into(view[got:n])
        conn.sendall(b"k")


async def _sink(request_iterator: AsyncIterator[bytes], context: object) -> bytes:
    num_bytes = 0
    async for message in request_iterator:
        num_bytes += len(message)
    return struct.pack("<Q", num_bytes)


async def serve(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    _, dst_ids, num_blocks = block_ids(args.total_mib * MiB)
    shared = SharedKvPools.create(LAYOUT, num_blocks)
    pools = Pools(num_blocks, fill=False, shared=shared)  # what same-host senders write
    ring_pools = Pools(num_blocks, fill=False)  # private: same-host senders use the ring
    receiver = KvReceiver(attach_segment=ShmAttacher(), shared_pools=shared)
    for i in range(args.num_requests):
        into = ring_pools if i % 3 == 2 else pools  # every third request: "shm_ring"
        receiver.reserve(KvReservation(f"r{i}", dst_ids, {KvPool.TARGET: into}, LAYOUT))
    server = grpc.aio.server(options=server_options(80 * MiB))
    add_kv_transfer_servicer(server, receiver)
    sink = {"Push": grpc.stream_unary_rpc_method_handler(_sink)}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SINK, sink),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    listener = socket.create_server(("127.0.0.1", 0))
    buffer = bytearray(args.total_mib * MiB + MiB)  # zero-filled: pre-touched
    threading.Thread(target=_raw_server, args=(listener, buffer), daemon=True).start()
    print(json.dumps({"port": port, "raw_port": listener.getsockname()[1]}), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    await server.stop(0)
    shared.close()


# ---------------------------------------------------------------- sender process


class Bench:
    def __init__(self, total_bytes: int, hello: dict[str, int], chunk_bytes: int) -> None:
        self.src_ids, self.dst_ids, num_blocks = block_ids(total_bytes)
        self.pools = Pools(num_blocks, fill=True)
        runs = merge_runs(self.src_ids, self.dst_ids)
        parts = [
            t[r.src_start : r.src_start + r.num_blocks].reshape(-1).view(torch.uint8)
            for k, v in self.pools.layers
            for r in runs
            for t in (k, v)
        ]
        self.payload = torch.cat(parts)  # the bytes a push carries, contiguous
        self.num_bytes = self.payload.numel()
        self.copy_dst = torch.zeros_like(self.payload)
        self.messages = [
            self.payload[i : i + chunk_bytes].numpy().tobytes()
            for i in range(0, self.num_bytes, chunk_bytes)
        ]
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{hello['port']}")
        self.sock = socket.create_connection(("127.0.0.1", hello["raw_port"]))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # Request ids 0, 1 mod 3 are reserved in the shared pools, 2 mod 3 in private ones.
        self.shared_ids = (i for i in itertools.count() if i % 3 != 2)
        self.ring_ids = (i for i in itertools.count() if i % 3 == 2)

    async def push(self, make: Callable[[], ChunkedKvSender], into_ring: bool = False) -> float:
        sender = make()
        request_id = next(self.ring_ids if into_ring else self.shared_ids)
        start = time.perf_counter()
        await sender.begin(Handshake(f"r{request_id}", LAYOUT))
        for layer, kv in enumerate(self.pools.layers):
            await sender.send_layer(KvPool.TARGET, layer, kv, self.src_ids, self.dst_ids)
        await sender.finish()
        assert sender.num_bytes_sent == self.num_bytes
        return self.num_bytes / (time.perf_counter() - start) / 1e9

    async def grpc_plain(self) -> float:
        start = time.perf_counter()
        call = self.channel.stream_unary(f"/{SINK}/Push")()
        for message in self.messages:
            await call.write(message)
        await call.done_writing()
        assert struct.unpack("<Q", await call)[0] == self.num_bytes
        return self.num_bytes / (time.perf_counter() - start) / 1e9

    async def raw_socket(self) -> float:
        start = time.perf_counter()
        self.sock.sendall(struct.pack("<Q", self.num_bytes))
        self.sock.sendall(self.payload.numpy().data)
        assert self.sock.recv(1) == b"k"
        return self.num_bytes / (time.perf_counter() - start) / 1e9

    async def memcpy(self) -> float:
        start = time.perf_counter()
        self.copy_dst.copy_(self.payload)
        return self.num_bytes / (time.perf_counter() - start) / 1e9


async def best_of(
    repeats: int, cases: dict[str, Callable[[], Awaitable[float]]]
) -> dict[str, float]:
    """Warm-up once, then ``repeats`` interleaved rounds; the best GB/s of each case."""
    best = dict.fromkeys(cases, 0.0)
    for round_ in range(repeats + 1):
        for name, case in cases.items():
            gbps = await case()
            if round_:
                best[name] = max(best[name], gbps)
                print(f"  {name:<11} {gbps:6.2f} GB/s", flush=True)
    return best


async def main(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    total = args.total_mib * MiB
    grid = [(c, w) for c in (1, 4, 16) for w in (2, 4, 8)] if args.sweep else []
    num_requests = 3 * (args.repeats + 1) * max(1, len(grid))
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    command = [sys.executable, __file__, "--serve", "--total-mib", str(args.total_mib)]
    receiver = subprocess.Popen(
        [*command, "--num-requests", str(num_requests)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
        text=True,
    )
    try:
        assert receiver.stdout is not None
        bench = Bench(total, json.loads(receiver.stdout.readline()), args.chunk_mib * MiB)
        kind = kind_name(checksum_kind(args.checksum))
        print(f"{bench.num_bytes / MiB:.0f} MiB per push, checksum {kind}", flush=True)
        if args.sweep:
            rows = []
            for chunk_mib, window in grid:
                options = TransferOptions(chunk_mib * MiB, window, args.checksum, 600, 80 * MiB)
                rings = ShmRingPool.for_options(options)
                print(f"chunk {chunk_mib} MiB, window {window}", flush=True)
                best = await best_of(
                    args.repeats,
                    {
                        "grpc": lambda o=options: bench.push(lambda: grpc_sender(bench.channel, o)),
                        "shm": lambda o=options, r=rings: bench.push(
                            lambda: shm_sender(bench.channel, r, o)
                        ),
                    },
                )
                rings.close()
                rows.append({"chunk_mib": chunk_mib, "window": window, **best})
            print(json.dumps({"sweep": rows}))
            return
        options = TransferOptions(args.chunk_mib * MiB, args.window, args.checksum, 600, 80 * MiB)
        rings = ShmRingPool.for_options(options)
        best = await best_of(
            args.repeats,
            {
                "grpc": lambda: bench.push(lambda: grpc_sender(bench.channel, options)),
                "grpc_plain": bench.grpc_plain,
                "raw_socket": bench.raw_socket,
                "shm": lambda: bench.push(lambda: shm_sender(bench.channel, rings, options)),
                "shm_ring": lambda: bench.push(
                    lambda: shm_sender(bench.channel, rings, options), into_ring=True
                ),
                "memcpy": bench.memcpy,
            },
        )
        rings.close()
        result = {
            "grpc_gbps": best["grpc"],
            "raw_socket_gbps": best["raw_socket"],
            "grpc_ratio": best["grpc"] / best["raw_socket"],
            "shm_gbps": best["shm"],
            "memcpy_gbps": best["memcpy"],
            "shm_ratio": best["shm"] / best["memcpy"],
            "grpc_plain_gbps": best["grpc_plain"],
            "shm_ring_gbps": best["shm_ring"],
        }
        print(json.dumps({k: round(v, 3) for k, v in result.items()}))
    finally:
        if receiver.stdin is not None:
            receiver.stdin.close()
        receiver.wait(30)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="64 MiB per push")
    parser.add_argument("--sweep", action="store_true", help="chunk size x window, grpc and shm")
    parser.add_argument("--total-mib", type=int, default=None, help="KV per push (default 256)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--chunk-mib", type=int, default=TransferOptions.chunk_bytes // MiB)
    parser.add_argument("--window", type=int, default=TransferOptions.window)
    parser.add_argument("--checksum", default="auto")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--num-requests", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.total_mib is None:
        args.total_mib = 64 if args.quick or args.sweep else 256
    return args


if __name__ == "__main__":
    arguments = parse_args()
    asyncio.run(serve(arguments) if arguments.serve else main(arguments))

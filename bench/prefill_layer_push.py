"""Prefill TTFT with the KV pushed after the prefill vs layer by layer as it is computed.

The decode side is a second process (this script with ``--serve``): paged pools shaped
like the model's, a KvReceiver behind a grpc.aio KvTransfer server, reservations made up
front. This process is the prefill side as a prefill worker runs it: an LLMEngine owned
by an EngineLoop thread, the asyncio loop pushing. Per long prompt (``--prompt-tokens``
random ids, prefix caching off, the engine's default 1024-token chunks), three modes,
interleaved, each figure the best of ``--repeats`` after a warm-up:

- ``compute``: the prefill alone, first token sampled (no push): the floor;
- ``after``: the previous prefill worker: prefill, then begin, every layer, finish;
- ``layered``: prefill_worker.kv_push: push opened at arrival, each layer's blocks sent
  as soon as the forward wrote them, finish after the last layer.

A mode's time runs from the request's arrival until the decode side acknowledged every
block (``compute``: until the first token): what the decode worker waits for before its
first step; figures ``*_s`` are the best of the repeats. ``*_tail_s`` (the median over the
repeats) is what the push adds after the first token, measured within each run: steadier
than differences between runs on a shared machine. Both transports: ``grpc`` (the
stream) and ``shm`` (shared-memory ring). Each process runs one torch thread (as the
launcher gives each process on 2 cores). The last line is one JSON object.

    python bench/prefill_layer_push.py                      # SmolLM2, bf16, 2048 tokens
    python bench/prefill_layer_push.py --dtype float32
    python bench/prefill_layer_push.py --quick              # 1 repeat, gRPC only
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import grpc  # type: ignore[import-untyped]  # no types-grpcio in the dev extra
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.kv_cache import KVCacheParams, PagedKVCache
from engine.llm_engine import EngineConfig, LLMEngine, RequestOutput
from engine.model_store import resolve_model
from engine.sampling_params import SamplingParams
from kv_transfer import (
    Handshake,
    KvLayout,
    KvReceiver,
    KvReservation,
    ShmAttacher,
    ShmRingPool,
    TransferOptions,
    add_kv_transfer_servicer,
    host_id,
    make_sender,
    server_options,
)
from kv_transfer.base import KvPool
from prefill_worker.kv_push import LayerPush, LayerRelay
from serving.engine_commands import AddRequest, DropRequest
from serving.engine_loop import EngineLoop

MODES = ("compute", "after", "layered")
NAME = "bench"


def layout_of(pools: dict[str, PagedKVCache]) -> KvLayout:
    return KvLayout.of_pools(NAME, pools["target"])


# ---------------------------------------------------------------- decode side (--serve)


async def serve(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype]
    num_layers, num_kv_heads, head_dim, block_size = json.loads(args.serve)
    params = KVCacheParams(num_layers, num_kv_heads, head_dim, block_size, dtype)
    pools = {"target": PagedKVCache(params, args.num_blocks, torch.device("cpu"))}
    receiver = KvReceiver(attach_segment=ShmAttacher())
    for i in range(args.num_requests):
        reservation = KvReservation(f"r{i}", range(args.num_blocks), pools, layout_of(pools))
        receiver.reserve(reservation)
    server = grpc.aio.server(options=server_options())
    add_kv_transfer_servicer(server, receiver)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(json.dumps({"port": port, "host_id": host_id()}), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    await server.stop(0)


# ---------------------------------------------------------------- prefill side


class Prefill:
    def __init__(self, engine: LLMEngine, channel: grpc.aio.Channel, hello: dict[str, Any]):
        self.engine = engine
        self.channel = channel
        self.hello = hello
        self.options = TransferOptions()
        self.rings = ShmRingPool.for_options(self.options)
        loop = asyncio.get_running_loop()
        self.relay = LayerRelay(loop, engine.device)
        engine.set_layer_listener(self.relay)
        self.waiting: dict[str, asyncio.Future[None]] = {}
        self.loop = EngineLoop(
            engine, loop, on_step=_first_tokens, deliver=self._deliver, on_error=self._error
        )
        self.loop.start()
        self.num_requests = 0

    def _deliver(self, done: list[str]) -> None:
        for rid in done:
            if (future := self.waiting.pop(rid, None)) is not None:
                future.set_result(None)

    def _error(self, error: BaseException) -> None:
        for future in self.waiting.values():
            future.set_exception(error)

    def sender(self, transport: str) -> Any:
        peer = self.hello["host_id"] if transport == "shm" else "another-host"
        return make_sender(self.channel, peer_host_id=peer, rings=self.rings, options=self.options)

    async def run(self, mode: str, transport: str, prompt: list[int]) -> tuple[float, float]:
        """Seconds from arrival to the decode side's acknowledgement, and to the first token."""
        rid = f"r{self.num_requests}"
        self.num_requests += 1
        engine = self.engine
        pools = engine.kv_pools
        bs = engine.config.block_size
        dst = list(range(-(-len(prompt) // bs)))
        handshake = Handshake(rid, layout_of(pools))
        start = time.perf_counter()
        push = None
        if mode == "layered":
            push = LayerPush(
                self.sender(transport), handshake, pools, dst, 0, bs, asyncio.Semaphore(1)
            )
            self.relay.register(rid, push)
        future = self.waiting[rid] = asyncio.get_running_loop().create_future()
        params = SamplingParams(max_tokens=16, temperature=0.0)
        await self.loop.call(AddRequest(rid, prompt, params, is_prefill_only=True))
        await future
        computed = time.perf_counter()
        if push is not None:
            await push.wait()
        elif mode == "after":  # the prefill worker's push before layer-by-layer
            table = engine.take_prefilled(rid)
            assert table is not None
            src = table.block_table[: len(dst)]
            sender = self.sender(transport)
            await sender.begin(handshake)
            for name, pool in pools.items():
                for layer, kv in enumerate(pool.layers):
                    await sender.send_layer(KvPool(name), layer, kv, src, dst)
            await sender.finish()
        done = time.perf_counter()
        if push is not None:
            self.relay.unregister(rid, push)
        await self.loop.call(DropRequest(rid))
        return done - start, computed - start

    def close(self) -> None:
        self.loop.stop()
        self.rings.close()


def _first_tokens(engine: LLMEngine, outputs: list[RequestOutput]) -> list[str]:
    return [o.request_id for o in outputs]


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    model = resolve_model(args.model)
    config = EngineConfig(
        model=str(model),
        dtype=args.dtype,
        block_size=16,
        num_threads=1,
        enable_prefix_caching=False,
        kv_cache_memory=args.kv_cache_mib << 20,
    )
    engine = LLMEngine(config)
    kv = engine.kv_cache.params
    transports = ["grpc"] if args.quick else ["grpc", "shm"]
    num_runs = (args.repeats + 1) * len(transports) * len(MODES)
    num_blocks = -(-args.prompt_tokens // kv.block_size)
    serve_params = [kv.num_layers, kv.num_kv_heads, kv.head_dim, kv.block_size]
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, __file__, "--serve", json.dumps(serve_params), "--dtype", args.dtype]
    command += ["--num-blocks", str(num_blocks), "--num-requests", str(num_runs)]
    proc = subprocess.Popen(
        command,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert proc.stdout is not None and proc.stdin is not None
    hello = json.loads(proc.stdout.readline())
    vocab = engine.model_config.vocab_size
    gen = torch.Generator().manual_seed(0)
    results: dict[str, dict[str, list[tuple[float, float]]]] = {
        t: {m: [] for m in MODES} for t in transports
    }
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{hello['port']}") as channel:
            prefill = Prefill(engine, channel, hello)
            try:
                for repeat in range(args.repeats + 1):  # the first round warms up
                    for transport in transports:
                        for mode in MODES:
                            prompt = torch.randint(3, vocab, (args.prompt_tokens,), generator=gen)
                            took = await prefill.run(mode, transport, prompt.tolist())
                            print(f"# {repeat} {transport} {mode}: {took[0]:.3f} s", flush=True)
                            if repeat:
                                results[transport][mode].append(took)
            finally:
                prefill.close()
    finally:
        proc.stdin.close()
        proc.wait(30)
    kv_bytes = num_blocks * kv.bytes_per_block
    figures: dict[str, Any] = {"prompt_tokens": args.prompt_tokens, "dtype": args.dtype}
    figures["kv_mib"] = round(kv_bytes / (1 << 20), 1)
    for transport in transports:
        runs = results[transport]
        best = {m: min(total for total, _ in runs[m]) for m in MODES}
        for mode in MODES:
            figures[f"{transport}_{mode}_s"] = round(best[mode], 3)
            first = statistics.median(first for _, first in runs[mode])
            figures[f"{transport}_{mode}_first_token_median_s"] = round(first, 3)
        for mode in ("after", "layered"):
            tail = statistics.median(total - first for total, first in runs[mode])
            figures[f"{transport}_{mode}_tail_s"] = round(tail, 4)
        figures[f"{transport}_layered_vs_after"] = round(best["layered"] / best["after"], 3)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2", help="prepared name or HF directory")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--kv-cache-mib", type=int, default=512)
    parser.add_argument("--quick", action="store_true", help="1 repeat, gRPC only")
    parser.add_argument("--serve", help=argparse.SUPPRESS)  # decode side: pool shape (JSON)
    parser.add_argument("--num-blocks", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--num-requests", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        asyncio.run(serve(args))
        return
    if args.quick:
        args.repeats = 1
    torch.set_num_threads(1)
    print(json.dumps(asyncio.run(bench(args))))


if __name__ == "__main__":
    main()

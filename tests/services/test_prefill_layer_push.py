"""The prefill worker's layer-by-layer push (prefill_worker/kv_push.py) on real engines:
each step's layer 0 starts leaving while the engine thread is still inside that step's
forward, for a one-chunk prompt and for prompts chunked on and off block bounds; every
reserved block of every layer is sent once; the decode side's blocks are bit-identical to
the prefill's blocks copied afterwards, and decoding from them equals one engine."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from engine.llm_engine import EngineConfig, LLMEngine
from engine.model_runner import StepKv
from engine.outputs import PrefilledRequest
from engine.sampling_params import SamplingParams
from engine.spec.config import SpeculativeConfig
from kv_transfer import (
    Handshake,
    KvLayout,
    KvPool,
    KvReceiver,
    KvReservation,
    KvSender,
    LoopbackTransport,
    TransferOptions,
    TransferState,
    add_kv_transfer_servicer,
    grpc_sender,
    server_options,
)
from prefill_worker.kv_push import LayerPush, LayerRelay
from tests.engine.joined import drain_joined
from tests.engine.tiny_drafts import build_random_draft
from tests.engine.tiny_models import build_tiny_llama

BLOCK_SIZE = 4
PROMPT = [(7 * i + 3) % 61 + 2 for i in range(21)]  # 21 tokens: 5 full blocks and 1 token
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
GATE_TIMEOUT_S = 20.0


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    out = tmp_path_factory.mktemp("layer_push")
    build_tiny_llama(out / "target", "gqa4_llama3rope_hd72_mlpbias", num_layers=3, vocab_size=64)
    build_random_draft(out / "target", out / "eagle3", "eagle3")
    return out / "target", out / "eagle3"


def make_engine(target: Path, draft: Path | None, max_num_batched_tokens: int) -> LLMEngine:
    spec = None if draft is None else SpeculativeConfig(str(draft), num_draft_tokens=3)
    config = EngineConfig(
        model=str(target),
        dtype="float32",
        block_size=BLOCK_SIZE,
        kv_cache_memory=1 << 21,
        max_num_batched_tokens=max_num_batched_tokens,
        speculative=spec,
    )
    return LLMEngine(config)


def layout_of(engine: LLMEngine) -> KvLayout:
    pools = engine.kv_pools
    fingerprint = "tiny-eagle3" if "draft" in pools else ""
    return KvLayout.of_pools("tiny", pools["target"], pools.get("draft"), fingerprint)


class RecordingSender(KvSender):
    """Delegates to ``inner``; logs each send_layer as it starts and signals layer 0."""

    def __init__(self, inner: KvSender, log: list[tuple[Any, ...]], started: threading.Event):
        super().__init__()
        self.inner, self.log, self.started = inner, log, started

    async def begin(self, handshake: Handshake) -> None:
        await self.inner.begin(handshake)

    async def send_layer(
        self,
        pool: KvPool,
        layer: int,
        src_cache_layer: tuple[torch.Tensor, torch.Tensor],
        src_block_ids: Sequence[int],
        dst_block_ids: Sequence[int],
    ) -> None:
        self.log.append(("send", pool.value, layer, tuple(dst_block_ids), time.perf_counter()))
        if pool is KvPool.TARGET and layer == 0:
            self.started.set()
        await self.inner.send_layer(pool, layer, src_cache_layer, src_block_ids, dst_block_ids)
        self.num_bytes_sent = self.inner.num_bytes_sent

    async def finish(self, extra_tensors: Mapping[str, torch.Tensor] | None = None) -> None:
        await self.inner.finish(extra_tensors)
        self.state = self.inner.state

    async def abort(self, reason: str) -> None:
        await self.inner.abort(reason)
        self.state = self.inner.state


@dataclass
class Gate:
    """The engine's layer listener in the test: relays, then, at layer 0 of a step that
    completes blocks, holds the engine thread (inside the forward) until that layer's send
    has started. A push that waited for the step to return would time out here."""

    relay: LayerRelay
    dst: list[int]
    first_block: int
    log: list[tuple[Any, ...]]
    started: threading.Event = field(default_factory=threading.Event)
    step: int = -1
    next_block: int = 0
    windows: list[tuple[int, int]] = field(default_factory=list)  # expected blocks per step

    def __post_init__(self) -> None:
        self.next_block = self.first_block

    def __call__(self, pool: str, layer: int, step: StepKv) -> None:
        if pool == "target" and layer == 0:
            self.step += 1
        self.log.append(("written", self.step, pool, layer, time.perf_counter()))
        self.relay(pool, layer, step)
        if pool != "target" or layer != 0:
            return
        (row,) = step.rows
        # the last chunk: up to the prompt's partial last block (lookahead blocks hold no KV)
        end = -(-row.end // BLOCK_SIZE) if row.is_last else row.end // BLOCK_SIZE
        end = min(end, len(self.dst))
        lo, hi = self.next_block, max(self.next_block, end)
        self.windows.append((lo, hi))
        self.next_block = hi
        if hi > lo:
            if not self.started.wait(GATE_TIMEOUT_S):
                raise AssertionError(f"step {self.step}: layer 0 not sent while the step ran")
            self.started.clear()


@dataclass
class Pushed:
    log: list[tuple[Any, ...]]
    windows: list[tuple[int, int]]
    prefilled: PrefilledRequest
    dst: list[int]  # the decode table's blocks that hold the prompt's KV
    first_block: int
    num_bytes: int


def kv_blocks(prompt: list[int]) -> int:
    """Blocks a push fills: the prompt's, its partial last one included."""
    return -(-len(prompt) // BLOCK_SIZE)


async def prefill_pushing(
    prefill: LLMEngine,
    decode: LLMEngine,
    rid: str,
    prompt: list[int],
    receiver: KvReceiver,
    make_sender: Callable[[], KvSender],
) -> Pushed:
    """Reserves on ``decode``, prefills on ``prefill`` in a thread while a LayerPush sends
    each layer into the reservation (as the prefill worker does)."""
    dst, num_cached = decode.reserve(rid, prompt, GREEDY)
    first, filled = num_cached // BLOCK_SIZE, kv_blocks(prompt)
    receiver.reserve(KvReservation(rid, dst[first:filled], decode.kv_pools, layout_of(decode)))
    log: list[tuple[Any, ...]] = []
    relay = LayerRelay(asyncio.get_running_loop(), torch.device("cpu"), prefill.kv_pools)
    gate = Gate(relay, dst, first, log)
    sender = RecordingSender(make_sender(), log, gate.started)
    handshake = Handshake(rid, layout_of(prefill))
    push = LayerPush(
        sender, handshake, prefill.kv_pools, dst, first, BLOCK_SIZE, asyncio.Semaphore(1)
    )
    relay.register(rid, push)
    prefill.set_layer_listener(gate)
    prefill.add_request(rid, prompt, GREEDY, is_prefill_only=True)

    def run() -> None:
        step = 0
        while prefill.has_unfinished_requests():
            prefill.step()
            log.append(("returned", step, time.perf_counter()))
            step += 1

    try:
        await asyncio.to_thread(run)
        num_bytes = await asyncio.wait_for(push.wait(), 30)
    finally:
        prefill.set_layer_listener(None)
        await push.stop("test ended")
    prefilled = prefill.take_prefilled(rid)
    assert prefilled is not None
    return Pushed(log, gate.windows, prefilled, dst[:filled], first, num_bytes)


def check_overlap(pushed: Pushed, num_steps: int) -> None:
    """Each step that completes blocks has its target layer 0 send start after the layer
    was written and before the step returned; it sends that step's window of blocks."""
    log = pushed.log
    returned = {e[1]: i for i, e in enumerate(log) if e[0] == "returned"}
    assert len(returned) == num_steps == len(pushed.windows)
    for step, (lo, hi) in enumerate(pushed.windows):
        if hi == lo:
            continue
        written = next(i for i, e in enumerate(log) if e[:4] == ("written", step, "target", 0))
        first_send = next(
            i
            for i, e in enumerate(log)
            if i > written and e[0] == "send" and e[1:3] == ("target", 0)
        )
        assert first_send < returned[step], f"step {step}: layer 0 sent after the step returned"
        assert log[first_send][3] == tuple(pushed.dst[lo:hi])


def check_each_block_once(pushed: Pushed, pools: Mapping[str, Any]) -> None:
    wanted = sorted(pushed.dst[pushed.first_block :])
    for name, cache in pools.items():
        for layer in range(len(cache.layers)):
            sent = [
                b for e in pushed.log if e[0] == "send" and e[1:3] == (name, layer) for b in e[3]
            ]
            assert sorted(sent) == wanted, f"{name} layer {layer}: sent {sent}"


def check_bits(pushed: Pushed, prefill: LLMEngine, decode: LLMEngine) -> None:
    """The decode side's blocks equal the prefill's blocks, bit for bit, copied now."""
    src = pushed.prefilled.block_table
    for name, cache in prefill.kv_pools.items():
        for layer, (src_kv, dst_kv) in enumerate(
            zip(cache.layers, decode.kv_pools[name].layers, strict=True)
        ):
            for j in range(pushed.first_block, len(pushed.dst)):
                for s, d in zip(src_kv, dst_kv, strict=True):
                    a, b = s[src[j]].view(torch.uint8), d[pushed.dst[j]].view(torch.uint8)
                    assert torch.equal(a, b), f"{name} layer {layer} block index {j}"


def finish_on(decode: LLMEngine, rid: str, prefilled: PrefilledRequest) -> list[int]:
    first = decode.start_decoding(rid, prefilled.first_token, prefilled.draft_token_ids)
    return drain_joined(decode, [first])[rid].token_ids


def reference(target: Path, draft: Path | None, chunk: int, prompt: list[int]) -> list[int]:
    whole = make_engine(target, draft, chunk)
    whole.add_request("ref", prompt, GREEDY)
    out: list[int] = []
    while whole.has_unfinished_requests():
        for o in whole.step():
            if o.finished:
                out = o.token_ids
    return out


def loopback_push(
    relay: LayerRelay, prefill: LLMEngine, receiver: KvReceiver, dst: list[int]
) -> LayerPush:
    """Request "r"'s push into ``dst`` through a loopback sender, registered with ``relay``
    (no engine clock)."""
    push = LayerPush(
        LoopbackTransport(receiver).sender(),
        Handshake("r", layout_of(prefill)),
        prefill.kv_pools,
        dst,
        0,
        BLOCK_SIZE,
        asyncio.Semaphore(1),
    )
    relay.register("r", push)
    return push


def loopback(receiver: KvReceiver) -> Callable[[], KvSender]:
    return LoopbackTransport(receiver).sender


# chunk = max_num_batched_tokens: one chunk; chunks on block bounds; chunks that straddle
# blocks (a block completed by the next chunk leaves with it).
@pytest.mark.parametrize("with_draft", [False, True], ids=["target", "eagle3"])
@pytest.mark.parametrize("chunk", [1024, 8, 6])
async def test_layers_leave_while_the_step_runs(
    dirs: tuple[Path, Path], with_draft: bool, chunk: int
) -> None:
    target, draft_dir = dirs
    draft = draft_dir if with_draft else None
    prefill, decode = make_engine(target, draft, chunk), make_engine(target, draft, chunk)
    receiver = KvReceiver()
    pushed = await prefill_pushing(prefill, decode, "r", PROMPT, receiver, loopback(receiver))
    num_steps = -(-len(PROMPT) // chunk)
    check_overlap(pushed, num_steps)
    check_each_block_once(pushed, prefill.kv_pools)
    assert receiver.state("r") is TransferState.DONE
    check_bits(pushed, prefill, decode)
    expected_bytes = sum(
        2 * c.layers[0][0][0].numel() * 4 * len(c.layers) * (len(pushed.dst) - pushed.first_block)
        for c in prefill.kv_pools.values()
    )
    assert pushed.num_bytes == expected_bytes
    receiver.drop("r")
    prefill.drop_request("r")
    assert prefill.block_manager.num_free_blocks == prefill.block_manager.num_blocks
    assert finish_on(decode, "r", pushed.prefilled) == reference(target, draft, chunk, PROMPT)


@pytest.mark.parametrize("with_draft", [False, True], ids=["target", "eagle3"])
@pytest.mark.parametrize(
    ("chunk", "group_layers"), [(1024, 2), (1024, None), (6, None)], ids=["2", "step", "chunked"]
)
async def test_layers_leave_in_groups(
    dirs: tuple[Path, Path], with_draft: bool, chunk: int, group_layers: int | None
) -> None:
    """Grouped by bytes, as the prefill worker relays them: a group of target layers goes
    over once it holds ``group_bytes`` of KV, and a pool's last layer of a step ends its
    group (None: a group larger than any step, so one hand-over per pool and step). The
    decode side gets the same bits, and decoding from them equals one engine."""
    target, draft_dir = dirs
    draft = draft_dir if with_draft else None
    prefill, decode = make_engine(target, draft, chunk), make_engine(target, draft, chunk)
    receiver = KvReceiver()
    dst, _ = decode.reserve("r", PROMPT, GREEDY)
    filled = dst[: kv_blocks(PROMPT)]
    receiver.reserve(KvReservation("r", filled, decode.kv_pools, layout_of(decode)))
    layers = prefill.kv_pools["target"].layers
    token_bytes = sum(t[0, 0].nbytes for t in layers[0])
    group_bytes = (group_layers or 1000) * len(PROMPT) * token_bytes
    relay = LayerRelay(
        asyncio.get_running_loop(), torch.device("cpu"), prefill.kv_pools, group_bytes
    )
    calls: list[tuple[str, int]] = []

    def listener(pool: str, layer: int, step: StepKv) -> None:
        calls.append((pool, layer))
        relay(pool, layer, step)

    push = loopback_push(relay, prefill, receiver, dst)
    prefill.set_layer_listener(listener)
    prefill.add_request("r", PROMPT, GREEDY, is_prefill_only=True)

    def run() -> None:
        while prefill.has_unfinished_requests():
            prefill.step()

    await asyncio.to_thread(run)
    await asyncio.wait_for(push.wait(), 30)
    assert receiver.state("r") is TransferState.DONE
    last_layers = sum(1 for pool, layer in calls if layer == len(prefill.kv_pools[pool].layers) - 1)
    # Three target layers in groups of two: layers 0-1 fill one, layer 2 ends the step's.
    expected = last_layers + (1 if group_layers == 2 else 0)
    assert len(layers) == 3 and relay.num_hand_overs == expected
    prefilled = prefill.take_prefilled("r")
    assert prefilled is not None
    pushed = Pushed([], [], prefilled, filled, 0, push.sender.num_bytes_sent)
    check_bits(pushed, prefill, decode)
    receiver.drop("r")
    prefill.drop_request("r")
    assert finish_on(decode, "r", prefilled) == reference(target, draft, chunk, PROMPT)


async def test_grpc_chunks_and_prefix_caches(dirs: tuple[Path, Path]) -> None:
    """Through the gRPC stream with chunks of about one layer's blocks: the same bits. The
    second request has its prefix cached on the prefill side (those blocks go with its
    first step); the third on the decode side too (those blocks are not sent)."""
    target, draft = dirs
    prefill = make_engine(target, draft, 6)
    decodes = [make_engine(target, draft, 6) for _ in range(2)]
    receiver = KvReceiver()
    server = grpc.aio.server(options=server_options())
    add_kv_transfer_servicer(server, receiver)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    options = TransferOptions(chunk_bytes=2048, window=2, timeout_s=30)
    try:
        prompts = {
            "a": (PROMPT, decodes[0]),
            "b": ([*PROMPT[:13], 5, 9, 11, 40, 41, 42, 3], decodes[1]),
            "c": ([*PROMPT[:13], 50, 51, 52, 53, 54], decodes[0]),
        }
        for rid, (prompt, decode) in prompts.items():
            pushed = await prefill_pushing(
                prefill, decode, rid, prompt, receiver, lambda: grpc_sender(channel, options)
            )
            assert receiver.state(rid) is TransferState.DONE
            check_each_block_once(pushed, prefill.kv_pools)
            check_bits(pushed, prefill, decode)
            if rid == "b":  # the prefill computed from its cached prefix; all sent
                assert pushed.prefilled.num_prompt_tokens == len(prompt)
                assert pushed.first_block == 0 and pushed.windows[0][0] == 0
            if rid == "c":
                assert pushed.first_block == 3
            receiver.drop(rid)
            prefill.drop_request(rid)
            got = finish_on(decode, rid, pushed.prefilled)
            assert got == reference(target, draft, 6, prompt)
        assert prefill.block_manager.num_prefix_hit_blocks == 6
    finally:
        await channel.close()
        await server.stop(0)


async def test_stop_mid_prefill_fails_the_receiver_and_frees(dirs: tuple[Path, Path]) -> None:
    target, draft = dirs
    prefill, decode = make_engine(target, draft, 8), make_engine(target, draft, 8)
    receiver = KvReceiver()
    dst, _ = decode.reserve("r", PROMPT, GREEDY)
    filled = dst[: kv_blocks(PROMPT)]
    receiver.reserve(KvReservation("r", filled, decode.kv_pools, layout_of(decode)))
    relay = LayerRelay(asyncio.get_running_loop(), torch.device("cpu"), prefill.kv_pools)
    push = loopback_push(relay, prefill, receiver, dst)
    prefill.set_layer_listener(relay)
    prefill.add_request("r", PROMPT, GREEDY, is_prefill_only=True)
    await asyncio.to_thread(prefill.step)  # the first of three chunks
    await asyncio.sleep(0.05)
    await push.stop("cancelled by the test")
    assert push.task.cancelled()
    assert receiver.state("r") is TransferState.FAILED
    assert "cancelled by the test" in receiver.failure("r")
    prefill.drop_request("r")
    assert prefill.block_manager.num_free_blocks == prefill.block_manager.num_blocks


def test_first_token_that_ends_the_request_keeps_blocks_until_release(
    dirs: tuple[Path, Path],
) -> None:
    """A push may still read the step's blocks: the engine frees them on release only."""
    target, _ = dirs
    prefill = make_engine(target, None, 1024)
    prefill.add_request("r", PROMPT, SamplingParams(max_tokens=1), is_prefill_only=True)
    (output,) = prefill.step()
    assert output.finished and prefill.take_prefilled("r") is None
    assert not prefill.has_unfinished_requests()
    assert prefill.block_manager.num_free_blocks < prefill.block_manager.num_blocks
    prefill.drop_request("r")
    assert prefill.block_manager.num_free_blocks == prefill.block_manager.num_blocks

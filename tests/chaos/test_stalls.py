"""Stalled workers (SIGSTOP, real processes): a decode worker frozen mid-stream answers no
keepalive ping, so the router gives up on it within 1.5 x --keepalive-ms and resumes its
streams on the other decode worker; the client sees one contiguous stream with the
in-process engine's greedy tokens. Resumed (SIGCONT), the worker finds its streams
cancelled and lets their blocks go: the audit is clean and it serves again. A prefill
worker frozen as requests arrive costs them a retry on the other one, not an error. A KV
push whose sender, alive, stops mid-way is failed by the decode worker within
--transfer-stall-s, naming the stall, and its blocks are free within seconds. A decode
worker that stops taking the pushes sent to it costs each of its requests one retry on the
other decode worker, never a second try on it."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import redis
import torch

from engine.llm_engine import EngineConfig, LLMEngine
from kv_transfer import Handshake, KvLayout, KvPool, TransferOptions, grpc_sender
from ledger.ledger import Ledger, RequestState
from serving.launcher import Cluster, Component
from tandem.v1 import kv_transfer_pb2 as kv_pb
from tandem.v1 import worker_pb2 as pb
from tandem.v1 import worker_pb2_grpc as pb_grpc
from tests.services.cluster_helpers import (
    SERVICE_ARGS,
    TINY_WORKER_ARGS,
    audit_command,
    build_tiny_target,
    check_stream,
    engine_greedy,
    generate_all,
    metric,
    router_counter,
    start_streams,
    tiny_cluster_spec,
    until,
    wait_audit_clean,
    worker_stats,
)

pytestmark = pytest.mark.timeout(300)
KEEPALIVE_MS = 2000
TRANSFER_STALL_S = 3.0  # well over any gap between one layer's chunks on a loaded machine
MAX_TOKENS = 500  # long enough that every stream is mid-way when its worker stops
KV_CACHE_BYTES = 64 << 20  # per worker, ample for the tiny model (not a share of the RAM)
PROMPTS = [[(5 * i + 3 * j) % 61 + 3 for j in range(5 + 3 * i)] for i in range(6)]
# Never sent before, and under a prefix block (16 tokens): no worker is preferred for them.
HELD_PROMPTS = [[(7 * i + 5 * j) % 59 + 3 for j in range(5 + 2 * i)] for i in range(6)]
# The same, for the forgetful decode worker's test (sent before the held one's).
FORGOT_PROMPTS = [[(11 * i + 3 * j) % 53 + 3 for j in range(5 + 2 * i)] for i in range(6)]
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.set_num_threads(1)  # this process shares the cores with the cluster's
    return build_tiny_target(tmp_path_factory.mktemp("stalls") / "target")


@pytest.fixture(scope="module")
def cluster(target: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    spec = tiny_cluster_spec(
        target,
        tmp_path_factory.mktemp("stalls_logs"),
        num_prefill=2,
        num_decode=2,
        service_args=(*SERVICE_ARGS, "--keepalive-ms", str(KEEPALIVE_MS)),
        worker_args=(
            *TINY_WORKER_ARGS,
            "--transfer-stall-s",
            str(TRANSFER_STALL_S),
            "--kv-cache-memory",
            str(KV_CACHE_BYTES),
        ),
    )
    with Cluster(spec) as started:
        yield started


async def audit_clean(cluster: Cluster) -> None:
    client = redis.Redis.from_url(cluster.redis_url, decode_responses=True)
    try:
        await wait_audit_clean(cluster, Ledger(client), within_s=15)
    finally:
        client.close()


async def test_a_frozen_decode_worker_streams_resume_elsewhere(
    cluster: Cluster, target: Path
) -> None:
    streams = await start_streams(cluster.router_address, PROMPTS, MAX_TOKENS, min_tokens=5)
    running = [(await worker_stats(d)).num_running for d in cluster.decode]
    frozen = cluster.decode[0] if running[0] >= running[1] else cluster.decode[1]
    frozen.process.send_signal(signal.SIGSTOP)
    try:
        assert max(streams.counts) < MAX_TOKENS, "a stream ended before the stop"
        results = await streams.results(timeout_s=120)
    finally:
        frozen.process.send_signal(signal.SIGCONT)
    ours = [check_stream(chunks, MAX_TOKENS) for chunks in results]
    assert ours == engine_greedy(target, PROMPTS, MAX_TOKENS)
    assert router_counter(cluster, "tandem_migrations_total") >= 1
    await audit_clean(cluster)
    # Both decode workers serve again (the frozen one registered anew).
    assert await generate_all(cluster.router_address, PROMPTS, 20) == engine_greedy(
        target, PROMPTS, 20
    )


async def test_requests_sent_to_a_frozen_prefill_worker_complete(
    cluster: Cluster, target: Path
) -> None:
    frozen = cluster.prefill[0]
    frozen.process.send_signal(signal.SIGSTOP)
    try:
        ours = await asyncio.wait_for(generate_all(cluster.router_address, PROMPTS, 20), 120)
    finally:
        frozen.process.send_signal(signal.SIGCONT)
    assert ours == engine_greedy(target, PROMPTS, 20)
    await audit_clean(cluster)


async def test_a_push_stalled_mid_way_is_failed_and_its_blocks_freed(
    cluster: Cluster, target: Path
) -> None:
    """This test is the sender: it reserves blocks on a decode worker, pushes target layer
    0 and stops, alive, its call open. The worker fails the push after --transfer-stall-s
    with a reply naming the stall, frees the blocks within a second more, the audit is
    clean, and the cluster serves the engine's greedy tokens after it."""
    decode = cluster.decode[0]
    stats = await worker_stats(decode)
    assert stats.num_kv_blocks_used == 0
    client = redis.Redis.from_url(cluster.redis_url, decode_responses=True)
    ledger = Ledger(client)
    rid, owner, epoch = "stalled-push", "a-router", 1
    ledger.create_request(rid, owner=owner, epoch=epoch)  # the router's part
    local = LLMEngine(
        EngineConfig(model=str(target), dtype="float32", block_size=4, kv_cache_memory=1 << 20)
    )
    layout = KvLayout.of_pools(stats.model, local.kv_pools["target"])
    # Never sent before: no block of it is cached on the worker, so every block of the
    # table is reserved for the push (a cached prefix block is not: pushing into it is
    # INVALID_CHUNK, "outside the reservation").
    prompt = [7] * 23
    try:
        async with grpc.aio.insecure_channel(decode.address) as channel:
            reserved = await pb_grpc.DecodeWorkerStub(channel).Reserve(
                pb.ReserveRequest(
                    request_id=rid,
                    num_prompt_tokens=len(prompt),
                    prompt_token_ids=prompt,
                    router_id=owner,
                    router_epoch=epoch,
                ),
                timeout=10,
            )
            assert reserved.num_cached_blocks == 0
            num_reserved = len(reserved.block_ids)
            assert (await worker_stats(decode)).num_kv_blocks_used == num_reserved > 1
            # A chunk per block: each leaves at once, none waits for the next layer.
            options = TransferOptions(chunk_bytes=layout.block_bytes(KvPool.TARGET))
            sender = grpc_sender(channel, options)
            await sender.begin(Handshake(rid, layout, reserved.epoch))
            kv = local.kv_pools["target"].layers[0]
            await sender.send_layer(
                KvPool.TARGET, 0, kv, range(num_reserved), list(reserved.block_ids)
            )
            sent = time.monotonic()
            reply = await asyncio.wait_for(sender.channel.stream.call, TRANSFER_STALL_S + 5)
            replied = time.monotonic()
            assert TRANSFER_STALL_S - 0.1 <= replied - sent < TRANSFER_STALL_S + 3
            assert reply.status == kv_pb.KV_PUSH_STATUS_INCOMPLETE, reply
            assert reply.num_chunks_received == num_reserved
            assert reply.message == (
                f"stalled: nothing moved for {TRANSFER_STALL_S:g} s while waiting for the next "
                "chunk (transfer_stall_s)"
            )
            while (await worker_stats(decode)).num_kv_blocks_used:
                assert time.monotonic() - replied < 3, "the stalled push's blocks are held"
                await asyncio.sleep(0.05)
        ledger.transition(rid, RequestState.FAILED, expected=RequestState.QUEUED, epoch=epoch)
        await wait_audit_clean(cluster, ledger, within_s=5)
    finally:
        client.close()
    assert await generate_all(cluster.router_address, PROMPTS, 20) == engine_greedy(
        target, PROMPTS, 20
    )


def restart_as(worker: Component, module: str, extra_args: list[str]) -> None:
    """Stops ``worker`` (a drain: it deregisters) and starts it again as ``module`` (a
    decode worker with one fault, in tests/chaos/): same id, port and options plus
    ``extra_args``, a new epoch."""
    worker.process.send_signal(signal.SIGTERM)
    worker.process.wait(timeout=30)
    command = list(worker.command)
    command[command.index("-m") + 1] = module
    command += extra_args
    if worker.log_file is not None:
        worker.log_file.close()
        assert worker.log_path is not None
        worker.log_file = worker.log_path.open("ab")
    worker.process = subprocess.Popen(
        command,
        env=dict(worker.env),
        cwd=REPO,
        stdin=subprocess.DEVNULL,
        stdout=worker.log_file,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


async def wait_serving(cluster: Cluster, worker: Component) -> None:
    deadline = time.monotonic() + 120
    while not await asyncio.to_thread(cluster.is_serving, worker):
        assert worker.process.poll() is None, worker.log_tail()
        assert time.monotonic() < deadline, f"{worker.name} did not start"
        await asyncio.sleep(0.2)
    role, live = (
        ("decode", cluster.decode) if worker in cluster.decode else ("prefill", cluster.prefill)
    )
    assert cluster.router is not None
    await until(
        lambda: metric(cluster.router, f"tandem_{role}_workers", "router") == len(live),
        f"the router picks from {worker.name} again",
    )


async def generate_until_logged(
    cluster: Cluster, target: Path, prompts: list[list[int]], log: Path
) -> list[str]:
    """Sends ``prompts`` (20 greedy tokens each, checked against the engine's) up to three
    times, until the faulty worker has logged a request: the router spreads them over both
    decode workers. The request ids it logged."""
    expected = engine_greedy(target, prompts, 20)
    for _ in range(3):
        assert await generate_all(cluster.router_address, prompts, 20) == expected
        if log.read_text():
            break
    return log.read_text().split()


async def test_a_reservation_dropped_before_its_decode_call_is_prefilled_again(
    cluster: Cluster, target: Path, tmp_path: Path
) -> None:
    """decode-1 drops each request's reservation once, as its Decode call arrives (as the
    worker does when the ledger lost the request's record, e.g. Redis restarted, or when
    it restarted between Reserve and Decode): the call is refused, and the router
    prefills the request again, avoiding decode-1 for it, instead of failing it. Every
    stream has the engine's greedy tokens and the audit is clean."""
    forgot_log = tmp_path / "forgot.txt"
    forgot_log.touch()
    forgetful = cluster.decode[1]
    restart_as(forgetful, "tests.chaos.forgetful_decode_worker", ["--forgot-log", str(forgot_log)])
    await wait_serving(cluster, forgetful)
    migrated = router_counter(cluster, "tandem_migrations_total")
    request_ids = await generate_until_logged(cluster, target, FORGOT_PROMPTS, forgot_log)
    assert request_ids, "no request was sent to the forgetful decode worker"
    assert router_counter(cluster, "tandem_migrations_total") - migrated == len(request_ids)
    await audit_clean(cluster)


def start_held(worker: Component, held_log: Path) -> None:
    """Starts ``worker`` again as tests/chaos/held_decode_worker.py: the gRPC transport
    only (no shared memory), and every push it receives held after the handshake. Its own
    --transfer-stall-s is far beyond the senders': theirs fires."""
    restart_as(
        worker,
        "tests.chaos.held_decode_worker",
        ["--held-log", str(held_log), "--kv-transport", "grpc", "--transfer-stall-s", "600"],
    )


@pytest.mark.last  # decode-1 stays held until the cluster stops
async def test_a_push_stalled_on_its_decode_worker_is_retried_on_the_other(
    cluster: Cluster, target: Path, tmp_path: Path
) -> None:
    """decode-1 takes each push's
    handshake and then nothing: its prefill worker fails the push after --transfer-stall-s
    (INCOMPLETE), and the router prefills the request again on decode-0, never on decode-1
    (each request is held there at most once). Every stream has the engine's greedy
    tokens; decode-1's blocks are free; `tandem ledger audit` is clean."""
    held_log = tmp_path / "held.txt"
    held_log.touch()
    held = cluster.decode[1]
    start_held(held, held_log)
    client = redis.Redis.from_url(cluster.redis_url, decode_responses=True)
    ledger = Ledger(client)
    try:
        await wait_serving(cluster, held)
        migrated = router_counter(cluster, "tandem_migrations_total")
        request_ids = await generate_until_logged(cluster, target, HELD_PROMPTS, held_log)
        assert request_ids, "no request was sent to the held decode worker"
        assert len(set(request_ids)) == len(request_ids), "a request went back to it"
        assert router_counter(cluster, "tandem_migrations_total") - migrated == len(request_ids)
        await wait_audit_clean(cluster, ledger, within_s=5)  # decode-1's blocks among them
        done = await audit_command(cluster, tmp_path)
        assert done.returncode == 0, done.stdout + done.stderr
        report = done.stdout
        num_workers = len(cluster.prefill) + len(cluster.decode)
        assert f"0 discrepancies, {num_workers} of {num_workers} workers audited" in report
    finally:
        client.close()

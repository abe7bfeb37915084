"""`tandem serve`'s supervisor on a real cluster (1 prefill + 1 decode worker, router and
redis-server as processes, loopback gRPC). A decode worker killed with SIGKILL mid-stream
is started again on its port with a new epoch; the streams it carried wait for it and
complete, equal to the in-process engine, and new requests are served. A request whose
prefill worker dies mid-prefill is prefilled again on its restarted instance. A worker that dies
on every start (its port taken) uses up its restart budget, and the supervisor gives up
naming it."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import torch

from ledger.ledger import Ledger, WorkerRole
from serving.launcher import Cluster, Component
from serving.supervisor import RestartPolicy, Supervisor
from tandem.v1 import worker_pb2 as pb
from tests.services.cluster_helpers import (
    build_tiny_target,
    check_stream,
    engine_greedy,
    non_final_requests,
    router_counter,
    run,
    start_streams,
    tiny_cluster_spec,
    until,
    wait_audit_clean,
    worker_stats,
)

MAX_TOKENS = 400  # long enough that every stream is mid-way when its worker is killed
PROMPTS = [[(7 * i + 5 * j) % 61 + 3 for j in range(4 + 5 * i)] for i in range(3)]
LATER_PROMPT = [11, 5, 42, 7, 9, 30, 12]  # sent once the restarted worker serves
TOKENS_BEFORE_KILL = 8


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.set_num_threads(1)  # this process shares the cores with the cluster's
    return build_tiny_target(tmp_path_factory.mktemp("supervise") / "target")


@pytest.fixture(scope="module")
def cluster(target: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with Cluster(tiny_cluster_spec(target, tmp_path_factory.mktemp("logs"))) as started:
        yield started


@contextlib.contextmanager
def supervising(cluster: Cluster) -> Iterator[list[str]]:
    """A supervisor watching ``cluster`` on a thread (quick restarts, up to 3); yields the
    lines it says."""
    lines: list[str] = []
    policy = RestartPolicy(max_restarts=3, initial_backoff_s=0.2, max_backoff_s=1.0)
    supervisor = Supervisor(cluster, policy, say=lines.append)
    stop = threading.Event()
    watcher = threading.Thread(target=supervisor.run, args=(stop, 0.1), daemon=True)
    watcher.start()
    try:
        yield lines
    finally:
        stop.set()
        watcher.join(timeout=10)


def registered_epoch(ledger: Ledger, worker_id: str) -> int | None:
    found = [w.epoch for w in ledger.list_workers(WorkerRole.DECODE) if w.worker_id == worker_id]
    return found[0] if found else None


async def test_killed_decode_worker_is_restarted_and_its_streams_complete(
    cluster: Cluster, target: Path
) -> None:
    client = redis.Redis.from_url(cluster.redis_url, decode_responses=True)
    ledger = Ledger(client)
    with supervising(cluster) as lines:
        try:
            decode = cluster.decode[0]
            epoch_before = registered_epoch(ledger, decode.name)
            blocks_before = num_blocks(await worker_stats(decode))
            streams = await start_streams(
                cluster.router_address, PROMPTS, MAX_TOKENS, min_tokens=TOKENS_BEFORE_KILL
            )
            old_pid = decode.process.pid
            decode.process.send_signal(signal.SIGKILL)
            assert max(streams.counts) < MAX_TOKENS, (
                "a stream ended before the kill: raise MAX_TOKENS"
            )
            results = await streams.results()

            expected = engine_greedy(target, [*PROMPTS, LATER_PROMPT], MAX_TOKENS)
            assert [check_stream(chunks, MAX_TOKENS) for chunks in results] == expected[:-1]
            assert router_counter(cluster, "tandem_migrations_total") >= 1
            assert decode.process.pid != old_pid and decode.num_restarts == 1
            epoch_after = registered_epoch(ledger, decode.name)
            assert epoch_before is not None and epoch_after is not None
            assert epoch_after > epoch_before
            assert any("decode-0 died (killed by SIGKILL); restarting it" in line for line in lines)
            assert any(line.startswith("decode-0 restarted (restart 1") for line in lines)

            later = await run(
                cluster.router_address,
                LATER_PROMPT,
                max_tokens=MAX_TOKENS,
                temperature=0.0,
                ignore_eos=True,
            )
            assert check_stream(later, MAX_TOKENS) == expected[-1]
            # The killed instance's holdings go by the new instance's claims or the reaper.
            await wait_audit_clean(cluster, ledger, within_s=10)
            assert any(line.startswith("decode-0 is SERVING again") for line in lines)
            # Sized by configuration, not by what the killed instance left free.
            assert num_blocks(await worker_stats(decode)) == blocks_before
        finally:
            client.close()


def num_blocks(stats: pb.StatsReply) -> int:
    return stats.num_kv_blocks_used + stats.num_kv_blocks_free


async def test_request_whose_prefill_worker_dies_mid_prefill_is_prefilled_again(
    cluster: Cluster, target: Path
) -> None:
    """P is stopped (SIGSTOP) before a request comes, so the router's Prefill waits on it,
    then killed: the router hears UNAVAILABLE before any token, takes the request back
    and prefills it again on P's restarted instance; the client sees only latency."""
    client = redis.Redis.from_url(cluster.redis_url, decode_responses=True)
    prefill = cluster.prefill[0]
    migrations_before = router_counter(cluster, "tandem_migrations_total")
    with supervising(cluster) as lines:
        try:
            prefill.process.send_signal(signal.SIGSTOP)  # still registered for ~0.9 s
            stream = asyncio.create_task(
                run(
                    cluster.router_address,
                    LATER_PROMPT,
                    max_tokens=32,
                    temperature=0.0,
                    ignore_eos=True,
                )
            )
            ledger = Ledger(client)
            await until(  # the router handed it to P and waits on its Prefill
                lambda: "PREFILLING" in non_final_requests(ledger).values(), "PREFILLING"
            )
            assert not stream.done()
            prefill.process.send_signal(signal.SIGKILL)
            chunks = await asyncio.wait_for(stream, timeout=60)

            assert check_stream(chunks, 32) == engine_greedy(target, [LATER_PROMPT], 32)[0]
            assert router_counter(cluster, "tandem_migrations_total") == migrations_before + 1
            assert prefill.num_restarts == 1
            assert any(
                "prefill-0 died (killed by SIGKILL); restarting it" in line for line in lines
            )
            await wait_audit_clean(cluster, Ledger(client), within_s=10)
        finally:
            client.close()


def take_port(component: Component) -> socket.socket:
    """Listens on ``component``'s port, so that a restarted instance cannot bind it."""
    host, port = component.address.rsplit(":", 1)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # no SO_REUSEPORT: gRPC's fails
    sock.bind((host, int(port)))
    sock.listen()
    return sock


def test_worker_dying_on_every_start_uses_up_its_budget(cluster: Cluster) -> None:
    lines: list[str] = []
    policy = RestartPolicy(max_restarts=2, initial_backoff_s=0.1, max_backoff_s=0.2)
    supervisor = Supervisor(cluster, policy, say=lines.append)
    prefill = cluster.prefill[0]
    restarts_before = prefill.num_restarts  # by the tests above
    prefill.process.send_signal(signal.SIGKILL)
    prefill.process.wait(timeout=10)
    blocker = take_port(prefill)
    try:
        result: list[int] = []
        stop = threading.Event()
        watcher = threading.Thread(
            target=lambda: result.append(supervisor.run(stop, 0.1)), daemon=True
        )
        watcher.start()
        watcher.join(timeout=90)
        stop.set()
        assert result == [1], lines
    finally:
        blocker.close()
    assert prefill.num_restarts == restarts_before + 2
    assert [line.split(" (")[0] for line in lines if "died" in line] == ["prefill-0 died"] * 3
    last = lines[-1]
    assert last.startswith("prefill-0 died (exit code 1) after 2 restarts in the last 60 s")
    assert "--max-restarts 2" in last and "giving up, stopping the cluster" in last
    assert "Failed to bind" in last  # the tail of its log

"""Prefill and decode workers of different tensor-parallel sizes, on a tiny random model
with an EAGLE-3 draft (real processes, a real redis-server, loopback gRPC): prefill TP 2
into decode TP 1, then prefill TP 2 into decode TP 2, then prefill TP 1 into decode TP 2.
Each rank holds its KV heads; the KV goes over the wire as whole heads (the workers' pools
are shared by their ranks: engine.executor.shared_kv), the draft's KV and drafts with it.
Then both at TP 2 with ranks that share no memory, as on CUDA: rank 0 gathers and scatters
a copy of every head (engine.executor.gathered_kv).
Greedy output equals the in-process engine's, each decode worker accepts as many drafts as
one engine doing everything, and the ledger audit is clean after each test. Then a TP-2
decode worker's rank 1 is SIGKILLed mid-stream: its worker goes down at once, the router
migrates its requests to the other decode worker, the client sees the target's tokens, and
no process of the dead worker is left.

One cluster for the module; each test arranges the sizes it needs (a worker of another
size joins, and the one it replaces drains and stops), so that it has exactly one pair,
in any order."""

from __future__ import annotations

import asyncio
import itertools
import random
import signal
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import psutil
import pytest
import redis
import torch

from engine.executor import shared_kv
from engine.spec.config import SpeculativeConfig
from ledger.ledger import Ledger, WorkerRole
from serving.launcher import Cluster, Component
from tests.engine.tiny_drafts import build_random_draft
from tests.engine.tiny_models import build_tiny_llama
from tests.services.cluster_helpers import (
    TINY_VOCAB,
    TINY_WORKER_ARGS,
    assert_greedy_equal,
    check_stream,
    engine_greedy,
    generate_all,
    greedy_engine,
    metric,
    router_counter,
    start_streams,
    tiny_cluster_spec,
    until,
    wait_audit_clean,
    worker_stats,
)
from tests.services.test_cluster_colocated import has_ended, rank_processes, started_by
from tests.services.test_cluster_tiny import K
from tests.services.tiny_tokenizer import save_char_tokenizer

WORKER_ARGS = (*TINY_WORKER_ARGS, "--kv-cache-memory", str(8 << 20))


def prompts(n: int, seed: int, max_len: int = 24) -> list[list[int]]:
    rng = random.Random(seed)
    return [
        [rng.randrange(3, TINY_VOCAB) for _ in range(rng.randint(1, max_len))] for _ in range(n)
    ]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    torch.set_num_threads(1)  # this process shares the cores with the cluster's
    out = tmp_path_factory.mktemp("cluster_tp")
    # 8 query heads, 2 KV heads: one KV head per rank at TP 2.
    build_tiny_llama(
        out / "target",
        "gqa4_llama3rope_hd72_mlpbias",
        num_layers=2,
        vocab_size=TINY_VOCAB,
        max_position_embeddings=2048,
    )
    # As test_cluster_tiny's: a seed and scale with which some drafts are accepted.
    build_random_draft(out / "target", out / "eagle3", "eagle3", seed=1, std=0.3)
    save_char_tokenizer(out / "target", TINY_VOCAB)
    return out / "target", out / "eagle3"


@pytest.fixture(scope="module")
def cluster(
    model_dirs: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    target, draft = model_dirs
    spec = tiny_cluster_spec(
        target,
        tmp_path_factory.mktemp("logs_tp"),
        draft=str(draft),
        num_draft_tokens=K,
        adaptive_speculation=False,  # K every step: counters as one engine's
        worker_args=WORKER_ARGS,
        prefill_args=("--tensor-parallel-size", "2"),
    )
    started = Cluster(spec).start(timeout_s=120)
    try:
        yield started
    finally:
        started.stop()


@pytest.fixture(scope="module")
def ledger(cluster: Cluster) -> Iterator[Ledger]:
    client = redis.Redis.from_url(cluster.redis_url, decode_responses=True)
    yield Ledger(client)
    client.close()


@pytest.fixture(autouse=True)
async def audit_after_each_test(cluster: Cluster, ledger: Ledger) -> AsyncIterator[None]:
    yield
    await wait_audit_clean(cluster, ledger, within_s=10.0)


def num_ranks(component: Component) -> int:
    return 1 + len(rank_processes(component.process.pid))


_NAMES = itertools.count(1)


def registered(ledger: Ledger, role: WorkerRole) -> set[str]:
    return {w.worker_id for w in ledger.list_workers(role)}


async def start_worker(cluster: Cluster, ledger: Ledger, role: WorkerRole, size: int) -> Component:
    """A worker of ``role`` with ``size`` ranks, joined to the cluster, SERVING and
    registered."""
    module = "prefill_worker" if role is WorkerRole.PREFILL else "decode_worker"
    name = f"{role.value}-tp{size}-{next(_NAMES)}"
    args = [*cluster.spec.engine_args()]
    if size > 1:
        args += ["--tensor-parallel-size", str(size)]
    new = cluster._spawn(name, module, args, True)
    (cluster.prefill if role is WorkerRole.PREFILL else cluster.decode).append(new)
    await until(
        lambda: cluster.is_serving(new) and name in registered(ledger, role), f"{name} serving", 120
    )
    assert num_ranks(new) == size
    return new


async def arrange(
    cluster: Cluster, ledger: Ledger, prefill: int, decode: int, *, fresh: bool = False
) -> None:
    """Exactly one prefill worker of ``prefill`` ranks and one decode worker of ``decode``:
    a worker of another size (any, ``fresh``) is replaced (the new one started first, then
    the old one stopped with SIGTERM, so that it drains and leaves the ledger)."""
    for role, size in ((WorkerRole.PREFILL, prefill), (WorkerRole.DECODE, decode)):
        workers = cluster.prefill if role is WorkerRole.PREFILL else cluster.decode
        if [num_ranks(w) for w in workers] == [size] and not fresh:
            continue
        new = await start_worker(cluster, ledger, role, size)
        for old in [w for w in workers if w is not new]:
            old.process.send_signal(signal.SIGTERM)
            await asyncio.to_thread(old.process.wait, 30)
            workers.remove(old)
        only = {new.name}
        await until(lambda: registered(ledger, role) == only, f"only {only} registered")  # noqa: B023


async def check_pair(
    cluster: Cluster,
    ledger: Ledger,
    model_dirs: tuple[Path, Path],
    seed: int,
    sizes: tuple[int, int],
) -> None:
    """Greedy streams through the one pair of these sizes: the target's tokens, and the
    decode worker's accepted drafts (counted from here) as one engine's, from the KV and
    drafts the prefill worker pushed."""
    target, draft = model_dirs
    await arrange(cluster, ledger, *sizes)
    (prefill,), (decode,) = cluster.prefill, cluster.decode
    pushed = metric(prefill, "tandem_kv_transfer_bytes_total", "prefill")
    before = (await worker_stats(decode)).speculative
    token_prompts = prompts(6, seed=seed)
    ours = await generate_all(cluster.router_address, token_prompts, max_tokens=20)
    assert metric(prefill, "tandem_kv_transfer_bytes_total", "prefill") > pushed
    assert_greedy_equal(target, token_prompts, ours, engine_greedy(target, token_prompts, 20))
    speculative = SpeculativeConfig(str(draft), num_draft_tokens=K)
    expected, engine = greedy_engine(target, token_prompts, 20, speculative)
    assert engine.spec is not None
    drafted, accepted = engine.spec.stats.num_draft_tokens, engine.spec.stats.num_accepted_tokens
    assert ours == expected and accepted > 0
    after = (await worker_stats(decode)).speculative
    assert (
        after.num_draft_tokens - before.num_draft_tokens,
        after.num_accepted_tokens - before.num_accepted_tokens,
    ) == (drafted, accepted)


async def test_prefill_tp_2_into_decode_tp_1(
    cluster: Cluster, ledger: Ledger, model_dirs: tuple[Path, Path]
) -> None:
    await check_pair(cluster, ledger, model_dirs, seed=1, sizes=(2, 1))


async def test_prefill_tp_2_into_decode_tp_2(
    cluster: Cluster, ledger: Ledger, model_dirs: tuple[Path, Path]
) -> None:
    await check_pair(cluster, ledger, model_dirs, seed=3, sizes=(2, 2))


async def test_prefill_tp_1_into_decode_tp_2(
    cluster: Cluster, ledger: Ledger, model_dirs: tuple[Path, Path]
) -> None:
    await check_pair(cluster, ledger, model_dirs, seed=5, sizes=(1, 2))


FAULT_TOKENS = 400  # long enough that every stream is mid-way when the rank is killed
FAULT_PROMPTS = [[(7 * i + 5 * j) % 61 + 3 for j in range(4 + 5 * i)] for i in range(4)]


async def test_a_killed_rank_of_a_tp_2_decode_worker_migrates_its_requests(
    cluster: Cluster, ledger: Ledger, model_dirs: tuple[Path, Path]
) -> None:
    """Streams on a TP-2 and a TP-1 decode worker; rank 1 of the TP-2 one is SIGKILLed
    mid-stream: that worker exits at once, the router resumes its streams on the other,
    and every stream completes with the target's greedy tokens. No process of it is left."""
    target, _ = model_dirs
    await arrange(cluster, ledger, 1, 2)
    (victim,) = cluster.decode
    (rank,) = rank_processes(victim.process.pid)
    await start_worker(cluster, ledger, WorkerRole.DECODE, 1)
    migrated = router_counter(cluster, "tandem_migrations_total")
    streams = await start_streams(cluster.router_address, FAULT_PROMPTS, FAULT_TOKENS, min_tokens=4)
    rank.kill()
    assert max(streams.counts) < FAULT_TOKENS, "a stream ended before the kill"
    code = await asyncio.to_thread(victim.process.wait, 10)
    assert code == 3  # serving.engine_loop.EXIT_RANK_LOST
    cluster.decode.remove(victim)
    results = await streams.results(timeout_s=180)
    ours = [check_stream(chunks, FAULT_TOKENS) for chunks in results]
    assert_greedy_equal(
        target, FAULT_PROMPTS, ours, engine_greedy(target, FAULT_PROMPTS, FAULT_TOKENS)
    )
    # The router spreads streams over both decode workers: some were the victim's.
    assert router_counter(cluster, "tandem_migrations_total") >= migrated + 1
    assert has_ended(rank) and not psutil.pid_exists(victim.process.pid)
    assert started_by(victim.process.pid) == []
    # The dead worker's holdings go when its lease (1 s) expires.
    await until(lambda: ledger.holdings() == [], "the dead worker's blocks reclaimed", 15)


async def test_ranks_that_share_no_memory_gather_and_scatter_the_kv(
    cluster: Cluster,
    ledger: Ledger,
    model_dirs: tuple[Path, Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Both workers at TP 2 with each rank's KV its own, as on CUDA: the prefill worker
    gathers its ranks' heads for the push, the decode worker scatters what it received
    (engine.executor.gathered_kv), the draft's KV with the target's. Last in the module:
    the workers it leaves are of that kind."""
    await arrange(cluster, ledger, 1, 2)
    assert maps_shared_kv(cluster.decode[0])  # its ranks' pools are shared
    monkeypatch.setenv("TANDEM_TP_SHARED_KV", "0")  # the workers started now inherit it
    await arrange(cluster, ledger, 2, 2, fresh=True)
    assert not any(maps_shared_kv(w) for w in (*cluster.prefill, *cluster.decode))
    await check_pair(cluster, ledger, model_dirs, seed=7, sizes=(2, 2))


def maps_shared_kv(worker: Component) -> bool:
    """Whether the worker's process maps its ranks' shared KV (engine.executor.shared_kv)."""
    return f"/memfd:{shared_kv.LABEL}" in Path(f"/proc/{worker.process.pid}/maps").read_text()

"""The whole cluster on a tiny random model: real router, prefill and decode processes
started by the `tandem serve` launcher, a real redis-server, loopback gRPC (KV through
shared memory with the draft, through the gRPC stream without). Greedy output equals the
in-process engine, with and without an EAGLE-3 draft; concurrent streams are complete and
contiguous; bad requests name their field; cancellation frees every block; the ledger
ends clean."""

from __future__ import annotations

import asyncio
import random
import re
import signal
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import redis
import torch
from transformers import AutoTokenizer

from engine.spec.config import SpeculativeConfig
from ledger.ledger import KvPool, Ledger, RequestState, WorkerRole
from serving.launcher import Cluster
from tandem.v1 import generation_pb2 as gen
from tandem.v1 import generation_pb2_grpc as gen_grpc
from tandem.v1 import kv_transfer_pb2 as kv_pb
from tandem.v1 import worker_pb2 as pb
from tandem.v1 import worker_pb2_grpc as pb_grpc
from tandem_client.cli import main as tandem_main
from tandem_client.client import build_request
from tests.engine.tiny_drafts import build_random_draft
from tests.engine.tiny_models import build_tiny_llama
from tests.services.cluster_helpers import (
    TINY_WORKER_ARGS,
    assert_audit_clean,
    assert_greedy_equal,
    audit_command,
    blocks_in_use,
    check_stream,
    engine_greedy,
    generate_all,
    greedy_engine,
    non_final_requests,
    run,
    shm_rings,
    start_streams,
    tiny_cluster_spec,
    tokens,
    wait_audit_clean,
    wait_until_freed,
    worker_stats,
)
from tests.services.tiny_tokenizer import save_char_tokenizer

VOCAB = 64
MAX_LEN = 256  # the tiny model's max_position_embeddings
K = 3
WORKER_ARGS = (*TINY_WORKER_ARGS, "--kv-cache-memory", str(24 << 20))


def prompts(n: int, seed: int, max_len: int = 24) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randint(1, max_len))] for _ in range(n)]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    torch.set_num_threads(1)  # this process shares the cores with the cluster's
    out = tmp_path_factory.mktemp("cluster_tiny")
    build_tiny_llama(out / "target", "gqa4_llama3rope_hd72_mlpbias", num_layers=2, vocab_size=VOCAB)
    # Seed and scale picked so that some drafts are accepted on these prompts.
    build_random_draft(out / "target", out / "eagle3", "eagle3", seed=1, std=0.3)
    save_char_tokenizer(out / "target", VOCAB)
    return out / "target", out / "eagle3"


def start_cluster(target: Path, draft: Path | None, log_dir: Path) -> Cluster:
    """With the draft, KV goes through shared memory; without, through the gRPC stream."""
    transport = ("--kv-transport", "auto" if draft else "grpc")
    spec = tiny_cluster_spec(
        target,
        log_dir,
        draft=str(draft) if draft else None,
        num_draft_tokens=K,
        adaptive_speculation=False,  # K every step: counters as one engine's
        worker_args=(*WORKER_ARGS, *transport),
    )
    return Cluster(spec).start(timeout_s=120)


@pytest.fixture(scope="module")
def clusters(
    model_dirs: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Cluster]]:
    """Two clusters, started side by side: with the EAGLE-3 draft (shared by the module)
    and without a draft (for one equality test)."""
    target, draft = model_dirs
    with ThreadPoolExecutor(2) as pool:
        futures = {
            name: pool.submit(start_cluster, target, d, tmp_path_factory.mktemp(f"logs_{name}"))
            for name, d in (("eagle3", draft), ("plain", None))
        }
        started = {}
        try:
            for name, future in futures.items():
                started[name] = future.result()
            yield started
        finally:
            for c in started.values():
                c.stop()


@pytest.fixture(scope="module")
def cluster(clusters: dict[str, Cluster]) -> Cluster:
    return clusters["eagle3"]


@pytest.fixture(scope="module")
def ledger(cluster: Cluster) -> Iterator[Ledger]:
    client = redis.Redis.from_url(cluster.redis_url, decode_responses=True)
    yield Ledger(client)
    client.close()


@pytest.fixture(autouse=True)
async def audit_after_each_test(cluster: Cluster, ledger: Ledger) -> AsyncIterator[None]:
    """After every test: nothing held by any worker or in the ledger, nothing live."""
    yield
    await wait_audit_clean(cluster, ledger)


async def test_greedy_with_eagle3_draft_equals_engine(
    cluster: Cluster, model_dirs: tuple[Path, Path]
) -> None:
    """Runs first on the shared cluster: its decode worker's draft counters are ours alone."""
    target, draft = model_dirs
    token_prompts = prompts(8, seed=1)
    ours = await generate_all(cluster.router_address, token_prompts, max_tokens=20)
    assert shm_rings(cluster), "same host: the KV went through shared-memory rings"
    assert_greedy_equal(target, token_prompts, ours, engine_greedy(target, token_prompts, 20))
    # The draft ran on the decode worker from the drafts and draft KV the prefill worker
    # sent: as many drafts accepted as by one engine doing everything.
    spec_refs, spec_engine = greedy_engine(
        target, token_prompts, 20, SpeculativeConfig(str(draft), num_draft_tokens=K)
    )
    assert spec_refs == ours
    assert spec_engine.spec is not None
    expected = spec_engine.spec.stats
    stats = (await worker_stats(cluster.decode[0])).speculative
    assert expected.num_accepted_tokens > 0
    assert (stats.num_draft_tokens, stats.num_accepted_tokens) == (
        expected.num_draft_tokens,
        expected.num_accepted_tokens,
    )


async def test_ledger_follows_the_decode_workers_allocator_mid_decode(
    cluster: Cluster, ledger: Ledger, capsys: pytest.CaptureFixture[str]
) -> None:
    """Long streams grow their block tables as they decode, and the ledger follows after
    each step, in both pools. Mid-decode, `tandem ledger audit` agrees (run here, not as a
    process, whose start would take most of the streams' second); then looks go on until
    the ledger has equalled the allocator (as its Stats before or after the ledger read
    saw it) at three table sizes. A block the ledger holds and the allocator does not is
    gone from one or the other within two more looks (the ledger follows a step later)."""
    decode = cluster.decode[0]
    max_tokens = 230  # prompts of 8 tokens at most: within the model's 256 positions
    streams = await start_streams(
        cluster.router_address, prompts(3, seed=5, max_len=8), max_tokens, min_tokens=4
    )
    command = ["ledger", "audit", "--redis-url", cluster.redis_url]
    assert await asyncio.to_thread(tandem_main, command) == 0, capsys.readouterr()
    assert max(streams.counts) < max_tokens, "the streams ended before the audit: longer ones"
    assert "0 discrepancies, 2 of 2 workers audited" in capsys.readouterr().out
    agreed: set[tuple[int, ...]] = set()  # table sizes at which the two were equal
    strays: list[set[int]] = []  # per look: blocks the ledger held, the allocator did not
    while len(agreed) < 3 and max(streams.counts) < max_tokens - 16:  # a look: a few tokens
        before = await worker_stats(decode, include_block_ids=True)
        holdings = ledger.holdings(decode.name)
        after = await worker_stats(decode, include_block_ids=True)
        owned = set(after.owned_block_ids)
        held = [h.blocks[KvPool.TARGET] for h in holdings]
        assert all(h.blocks[KvPool.DRAFT] == h.blocks[KvPool.TARGET] for h in holdings)
        strays.append(set().union(*held) - owned)
        assert not set.intersection(*strays[-3:]) or len(strays) < 3, strays[-3:]
        if len(held) == 3 and set().union(*held) in (set(before.owned_block_ids), owned):
            agreed.add(tuple(sorted(len(b) for b in held)))
    assert len(agreed) >= 3, agreed  # the ledger kept up with the tables as they grew
    assert [len(check_stream(c, max_tokens)) for c in await streams.results()] == [max_tokens] * 3


async def test_greedy_without_draft_equals_engine(
    clusters: dict[str, Cluster], model_dirs: tuple[Path, Path]
) -> None:
    target, _ = model_dirs
    plain = clusters["plain"]
    token_prompts = prompts(8, seed=2)
    ours = await generate_all(plain.router_address, token_prompts, max_tokens=20)
    assert not shm_rings(plain), "--kv-transport grpc: no shared memory"
    assert (await worker_stats(plain.decode[0])).HasField("speculative") is False
    await asyncio.to_thread(plain.stop)  # its cores are the other cluster's again
    assert_greedy_equal(target, token_prompts, ours, engine_greedy(target, token_prompts, 20))


async def test_32_concurrent_mixed_requests_complete_in_order(cluster: Cluster) -> None:
    rng = random.Random(3)
    token_prompts = prompts(32, seed=3, max_len=60)
    jobs = []
    for i, p in enumerate(token_prompts):
        params: dict[str, object] = {"max_tokens": rng.choice([1, 2, 7, 16, 40])}
        if i % 3 == 0:
            params.update(temperature=0.8, seed=1000 + i)
        else:
            params.update(temperature=0.0)
        if i % 4 == 0:
            params["stop_token_ids"] = [rng.randrange(3, VOCAB)]
        params["ignore_eos"] = i % 5 != 0
        jobs.append((p, params))
    results = await asyncio.gather(*(run(cluster.router_address, p, **kw) for p, kw in jobs))
    for (_, params), chunks in zip(jobs, results, strict=True):
        ids = check_stream(chunks, int(params["max_tokens"]))  # type: ignore[call-overload]
        last = chunks[-1]
        if last.finish_reason == gen.FINISH_REASON_STOP:
            assert last.stop_token_id == ids[-1]
    # A seeded sampled request is reproducible through the cluster.
    p, params = jobs[0]
    again = await run(cluster.router_address, p, **params)
    assert tokens(again) == tokens(results[0])


def invalid_requests() -> list[tuple[gen.GenerateRequest, str]]:
    ok = [5, 6, 7]
    return [
        (gen.GenerateRequest(), "prompt"),
        (build_request([]), "token_ids"),
        (build_request([5, VOCAB]), "token_ids"),
        (build_request(ok, stop_token_ids=[VOCAB + 3]), "stop_token_ids"),
        (build_request(ok, temperature=-1.0), "temperature"),
        (build_request(ok, top_p=0.0), "top_p"),
        (build_request(ok, max_tokens=0), "max_tokens"),
        (build_request(ok, logprobs=21), "logprobs"),
        (build_request(ok, stop=[f"s{i}" for i in range(17)]), "stop"),
        (build_request(ok, model="no-such-model"), "model"),
        (build_request([5] * 250, max_tokens=16), "max_tokens"),
        (build_request("x" * (64 * MAX_LEN + 1)), "text"),
        (gen.GenerateRequest(chat=gen.ChatMessages()), "chat"),
        (build_request(ok, request_id="bad id!"), "request_id"),
        (build_request([5] * (1 << 20) + [6] * 100_000), "token_ids"),
    ]


async def test_invalid_requests_name_the_field(cluster: Cluster) -> None:
    async with grpc.aio.insecure_channel(cluster.router_address) as channel:
        stub = gen_grpc.GenerationStub(channel)
        for request, field in invalid_requests():
            with pytest.raises(grpc.aio.AioRpcError) as info:
                async for _ in stub.Generate(request, timeout=10):
                    pass
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (field, info.value)
            assert re.match(rf"{field}: ", info.value.details() or ""), info.value.details()


async def test_client_cancel_frees_prefill_and_decode_blocks(
    cluster: Cluster, ledger: Ledger
) -> None:
    async with grpc.aio.insecure_channel(cluster.router_address) as channel:
        request = build_request(
            [7] * 8, request_id="cancel-me", max_tokens=240, temperature=0.0, ignore_eos=True
        )
        call = gen_grpc.GenerationStub(channel).Generate(request, timeout=60)
        first = await call.read()
        assert first.index == 0
        _, d_used = await blocks_in_use(cluster)
        assert d_used > 0
        call.cancel()
    assert await wait_until_freed(cluster, ledger, "cancel-me", within_s=1.0) < 1.0
    record = ledger.get_request("cancel-me")
    assert record is not None and record.state is RequestState.CANCELLED


async def test_deadline_cancels_and_frees(cluster: Cluster, ledger: Ledger) -> None:
    async with grpc.aio.insecure_channel(cluster.router_address) as channel:
        request = build_request(
            [9] * 8, request_id="too-slow", max_tokens=240, temperature=0.0, ignore_eos=True
        )
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in gen_grpc.GenerationStub(channel).Generate(request, timeout=0.3):
                pass
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    await wait_until_freed(cluster, ledger, "too-slow", within_s=2.0)
    record = ledger.get_request("too-slow")
    assert record is not None and record.state is RequestState.CANCELLED


async def test_tiny_deadlines_leave_the_workers_in_service(cluster: Cluster) -> None:
    """A deadline that runs out on the router says nothing about the workers: it answers
    DEADLINE_EXCEEDED and never passes a worker over, so the next request is served."""
    prompt = [7] * 8
    codes = set()
    async with grpc.aio.insecure_channel(cluster.router_address) as channel:
        stub = gen_grpc.GenerationStub(channel)
        for deadline_ms in range(1, 41):
            request = build_request(prompt, max_tokens=2, temperature=0.0, ignore_eos=True)
            try:
                async for _ in stub.Generate(request, timeout=deadline_ms / 1000):
                    pass
            except grpc.aio.AioRpcError as e:
                codes.add(e.code())
    assert codes <= {grpc.StatusCode.DEADLINE_EXCEEDED}, codes
    start = time.monotonic()
    chunks = await run(cluster.router_address, prompt, max_tokens=4, temperature=0.0)
    assert len(tokens(chunks)) == 4
    assert time.monotonic() - start < 10  # no worker waited out as unreachable


async def test_text_chat_and_stop_strings(cluster: Cluster, model_dirs: tuple[Path, Path]) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(model_dirs[0]))
    greedy: dict[str, object] = {"max_tokens": 24, "temperature": 0.0, "ignore_eos": True}
    address = cluster.router_address
    chunks = await run(address, "Hello world", **greedy)
    ids = check_stream(chunks, 24)
    text = "".join(c.text for c in chunks)
    assert text == tokenizer.decode(ids, skip_special_tokens=True)
    assert tokens(await run(address, tokenizer.encode("Hello world"), **greedy)) == ids

    stop = text[6:8]
    assert len(stop) == 2
    stopped = await run(address, "Hello world", stop=[stop], **greedy)
    last = stopped[-1]
    assert last.finish_reason == gen.FINISH_REASON_STOP and last.stop_string == stop
    assert "".join(c.text for c in stopped) == text[: text.index(stop)]
    assert ids[: len(tokens(stopped))] == tokens(stopped)

    chat = [{"role": "user", "content": "Hi there"}]
    chunks = await run(address, chat, **greedy)  # type: ignore[arg-type]
    rendered = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    prompt = tokenizer.encode(rendered, add_special_tokens=False)
    assert check_stream(chunks, 24) == tokens(await run(address, prompt, **greedy))


async def test_list_models(cluster: Cluster, model_dirs: tuple[Path, Path]) -> None:
    async with grpc.aio.insecure_channel(cluster.router_address) as channel:
        reply = await gen_grpc.GenerationStub(channel).ListModels(
            gen.ListModelsRequest(), timeout=5
        )
    (model,) = reply.models
    assert (model.name, model.max_model_len, model.draft_kind) == ("target", MAX_LEN, "eagle3")
    assert model.draft_model == model_dirs[1].name


@pytest.mark.last
async def test_ledger_audit_is_clean_at_the_end(cluster: Cluster, ledger: Ledger) -> None:
    """Every request of the module ended, nothing is held anywhere."""
    await assert_audit_clean(cluster, ledger)


async def test_tandem_ledger_audit_command_is_clean(cluster: Cluster, tmp_path: Path) -> None:
    """`tandem ledger audit` asks the workers itself and agrees: exit 0, no discrepancy."""
    done = await audit_command(cluster, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    num_workers = len(cluster.prefill) + len(cluster.decode)
    expected = f"0 discrepancies, {num_workers} of {num_workers} workers audited"
    assert expected in done.stdout


def test_router_metrics_count_the_requests(cluster: Cluster) -> None:
    assert cluster.router is not None and cluster.router.metrics_url
    with urllib.request.urlopen(cluster.router.metrics_url, timeout=5) as response:
        text = response.read().decode()
    finished = re.search(
        r'^tandem_requests_total\{role="router",status="finished"\} (\S+)$', text, re.M
    )
    assert finished is not None and float(finished.group(1)) > 0, text[:2000]


@pytest.mark.last  # stops the router
async def test_router_drains_on_sigterm(cluster: Cluster, ledger: Ledger) -> None:
    """An in-flight stream finishes, new requests are refused."""
    assert cluster.router is not None
    async with grpc.aio.insecure_channel(cluster.router_address) as channel:
        stub = gen_grpc.GenerationStub(channel)
        request = build_request([4] * 6, max_tokens=200, temperature=0.0, ignore_eos=True)
        call = stub.Generate(request, timeout=60)
        first = await call.read()
        cluster.router.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        with pytest.raises(grpc.aio.AioRpcError) as info:
            while time.monotonic() < deadline:  # served until the router takes the signal
                async for _ in stub.Generate(build_request([4], max_tokens=2), timeout=5):
                    pass
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        rest = []
        while (chunk := await call.read()) != grpc.aio.EOF:
            rest.append(chunk)
    assert check_stream([first, *rest], 200) and rest[-1].finish_reason == gen.FINISH_REASON_LENGTH
    assert await asyncio.to_thread(cluster.router.process.wait, 10) == 0
    assert ledger.holdings() == [] and non_final_requests(ledger) == {}


async def test_a_refused_push_frees_its_reservation_within_a_second(
    cluster: Cluster, ledger: Ledger
) -> None:
    """A reservation whose push was refused can take no other push: it is freed at once,
    not after the reservation timeout (60 s) that waits for a Decode that never comes."""
    decode = cluster.decode[0]
    rid = "refused-push"
    owner, epoch = "a-router", 1  # the module's router may be stopped by now
    decode_info = next(w for w in ledger.list_workers(WorkerRole.DECODE))
    ledger.create_request(rid, owner=owner, epoch=epoch)
    async with grpc.aio.insecure_channel(decode.address) as channel:
        reserved = await pb_grpc.DecodeWorkerStub(channel).Reserve(
            pb.ReserveRequest(
                request_id=rid,
                num_prompt_tokens=3,
                prompt_token_ids=[5, 6, 7],
                router_id=owner,
                router_epoch=epoch,
                draft_fingerprint=decode_info.stats["draft_fingerprint"],
            ),
            timeout=10,
        )
        assert (await worker_stats(decode)).num_kv_blocks_used == len(reserved.block_ids) > 0
        assert reserved.host_id and not reserved.kv_pools_bus_id  # pools on the host: no GPU
        handshake = kv_pb.KvHandshake(
            request_id=rid, model="not-this-one", decode_epoch=reserved.epoch
        )

        async def messages() -> AsyncIterator[bytes]:
            yield kv_pb.KvPushMessage(handshake=handshake).SerializeToString()

        push = channel.stream_unary("/tandem.v1.KvTransfer/Push")
        reply = kv_pb.KvPushReply.FromString(await push(messages(), timeout=10))
    assert reply.status == kv_pb.KV_PUSH_STATUS_INCOMPATIBLE, reply
    refused = time.monotonic()
    while (await worker_stats(decode)).num_kv_blocks_used:
        assert time.monotonic() - refused < 1.0, "the refused reservation still holds blocks"
        await asyncio.sleep(0.05)
    ledger.transition(
        rid, RequestState.FAILED, expected=RequestState.QUEUED, epoch=epoch
    )  # the router's part: it made the record


async def test_a_first_token_said_to_end_the_request_must_end_it_here(
    cluster: Cluster, ledger: Ledger
) -> None:
    """A Decode whose first token ended the request on the prefill worker (no KV pushed)
    with a token that ends it neither by the engine's checks nor by a stop string in its
    text: INVALID_ARGUMENT naming the token, and the reservation freed. With a stop string
    that its text holds, the same call ends the request with that string."""
    decode = cluster.decode[0]
    decode_info = next(w for w in ledger.list_workers(WorkerRole.DECODE))
    owner, epoch = "a-router", 1
    async with grpc.aio.insecure_channel(decode.address) as channel:
        stub = pb_grpc.DecodeWorkerStub(channel)

        async def decode_first(rid: str, stop: list[str]) -> list[gen.GenerateChunk]:
            ledger.create_request(rid, owner=owner, epoch=epoch)
            sampling = gen.SamplingParams(max_tokens=8, temperature=0.0, stop=stop)
            reserved = await stub.Reserve(
                pb.ReserveRequest(
                    request_id=rid,
                    num_prompt_tokens=3,
                    prompt_token_ids=[5, 6, 7],
                    sampling=sampling,
                    router_id=owner,
                    router_epoch=epoch,
                    draft_fingerprint=decode_info.stats["draft_fingerprint"],
                ),
                timeout=10,
            )
            request = pb.DecodeRequest(
                request_id=rid,
                epoch=reserved.epoch,
                first_token_id=40,  # "L" to the tiny tokenizer: neither EOS nor a stop id
                is_finished_on_prefill=True,
            )
            try:
                return [chunk async for chunk in stub.Decode(request, timeout=10)]
            finally:
                ledger.transition(
                    rid, RequestState.FAILED, expected=RequestState.QUEUED, epoch=epoch
                )

        with pytest.raises(grpc.aio.AioRpcError) as info:
            await decode_first("ended-elsewhere", [])
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "first_token: 40 ended request 'ended-elsewhere'" in (info.value.details() or "")
        chunks = await decode_first("ended-by-its-text", ["L"])
    assert chunks[-1].finish_reason == gen.FINISH_REASON_STOP and chunks[-1].stop_string == "L"
    assert list(chunks[-1].token_ids) == [40] and chunks[-1].text == ""
    ended = time.monotonic()
    while (await worker_stats(decode)).num_kv_blocks_used:
        assert time.monotonic() - ended < 5.0, "a request ended on its first token holds blocks"
        await asyncio.sleep(0.05)

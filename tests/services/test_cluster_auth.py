"""Opt-in authentication on a real tiny cluster (router, prefill and decode worker as
processes, the embedded redis-server): the router's bearer token over gRPC (the SDK, the
CLI) and HTTP (the official ``openai`` package), the cluster secret on worker RPCs from an
outside client, the embedded Redis's password, and `tandem ledger audit` given both."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx2 as httpx
import openai
import pytest
import redis
import torch

from kv_transfer.grpc_transport import PUSH_METHOD
from serving.auth import CLUSTER_SECRET_KEY
from serving.launcher import Cluster
from tandem.v1 import worker_pb2 as pb
from tandem.v1 import worker_pb2_grpc as pb_grpc
from tandem_client import TandemClient, Unauthenticated
from tests.services.cluster_helpers import (
    assert_greedy_equal,
    build_tiny_target,
    engine_greedy,
    tiny_cluster_spec,
)

pytestmark = pytest.mark.timeout(240)
MODEL = "target"  # the served name: the model directory's
TOKEN = "s3cret-token-for-tests"
PROMPT = [5, 9, 14, 3, 22]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.set_num_threads(1)  # this process shares the cores with the cluster's
    return build_tiny_target(tmp_path_factory.mktemp("auth") / MODEL)


@pytest.fixture(scope="module")
def token_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("auth_secrets") / "token"
    path.write_text(TOKEN + "\n")
    path.chmod(0o600)
    return path


@pytest.fixture(scope="module")
def cluster(
    target: Path, token_file: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    logs = tmp_path_factory.mktemp("auth_logs")
    spec = tiny_cluster_spec(target, logs, auth_token_file=token_file)
    with Cluster(spec) as cluster:
        yield cluster


def test_grpc_requires_the_token(cluster: Cluster, target: Path) -> None:
    address = cluster.router_address
    with TandemClient(address, timeout=60, max_retries=0) as client:
        assert client.health() == "SERVING"  # grpc.health.v1 stays open
        with pytest.raises(Unauthenticated, match="authorization: Bearer"):
            client.generate(PROMPT, max_tokens=MAX_TOKENS, temperature=0.0)
    wrong = TandemClient(address, timeout=60, max_retries=0, token=TOKEN + "x")
    with wrong as client, pytest.raises(Unauthenticated):
        client.generate(PROMPT, max_tokens=MAX_TOKENS, temperature=0.0)
    with TandemClient(address, timeout=60, max_retries=0, token=TOKEN) as client:
        assert [m.name for m in client.models()] == [MODEL]
        done = client.generate(PROMPT, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    ref = engine_greedy(target, [PROMPT], MAX_TOKENS)
    assert_greedy_equal(target, [PROMPT], [list(done.token_ids)], ref)


def test_cli_token(cluster: Cluster) -> None:
    def generate(*token: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "tandem_client", "generate", "--router"]
        command += [cluster.router_address, *token, "--max-tokens", "4", "abc"]
        return subprocess.run(command, capture_output=True, text=True, timeout=60)

    refused = generate()
    assert refused.returncode == 7, refused.stderr  # ExitCode.UNAUTHENTICATED
    assert "Bearer" in refused.stderr
    accepted = generate("--token", TOKEN)
    assert accepted.returncode == 0, accepted.stderr


def test_http_requires_the_token(cluster: Cluster) -> None:
    assert cluster.router is not None
    base_url = cluster.router.base_url
    health = httpx.get(base_url.removesuffix("/v1") + "/health", timeout=10)
    assert health.status_code == 200  # open
    missing = httpx.post(f"{base_url}/completions", content=b"{not json", timeout=10)
    assert missing.status_code == 401  # refused before the body is read
    assert missing.json() == {
        "error": {
            "message": missing.json()["error"]["message"],
            "type": "authentication_error",
            "param": None,
            "code": "invalid_api_key",
        }
    }
    assert "Authorization: Bearer" in missing.json()["error"]["message"]
    with openai.OpenAI(base_url=base_url, api_key="wrong", max_retries=0) as client:
        with pytest.raises(openai.AuthenticationError) as refused:
            client.models.list()
        assert refused.value.status_code == 401
    with openai.OpenAI(base_url=base_url, api_key=TOKEN, max_retries=0) as client:
        assert [m.id for m in client.models.list()] == [MODEL]
        reply = client.completions.create(
            model=MODEL, prompt="abc", max_tokens=4, temperature=0, extra_body={"ignore_eos": True}
        )
    assert reply.usage is not None and reply.usage.completion_tokens == 4


async def test_worker_rpcs_need_the_cluster_secret(cluster: Cluster) -> None:
    decode, prefill = cluster.decode[0], cluster.prefill[0]
    assert cluster.cluster_secret  # generated by the launcher, handed over in the environment
    async with grpc.aio.insecure_channel(decode.address) as channel:
        stub = pb_grpc.DecodeWorkerStub(channel)
        for call, request in ((stub.Stats, pb.StatsRequest()), (stub.Reserve, pb.ReserveRequest())):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await call(request, timeout=10)
            assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED
            assert CLUSTER_SECRET_KEY in (refused.value.details() or "")
        wrong = ((CLUSTER_SECRET_KEY, cluster.cluster_secret + "x"),)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.Stats(pb.StatsRequest(), timeout=10, metadata=wrong)
        assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED
        push = channel.stream_unary(PUSH_METHOD, request_serializer=None)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await push(iter([b"\x0a\x00"]), timeout=10)
        assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED
        right = ((CLUSTER_SECRET_KEY, cluster.cluster_secret),)
        stats = await stub.Stats(
            pb.StatsRequest(include_block_ids=True), timeout=10, metadata=right
        )
        assert stats.num_kv_blocks_used == 0
    async with grpc.aio.insecure_channel(prefill.address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await pb_grpc.PrefillWorkerStub(channel).Stats(pb.StatsRequest(), timeout=10)
        assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED
    assert cluster.is_serving(decode) and cluster.is_serving(prefill)  # health stays open
    # The cluster itself works: the router's calls to both workers carry the secret.
    with TandemClient(cluster.router_address, timeout=60, max_retries=0, token=TOKEN) as client:
        assert len(client.generate(PROMPT, max_tokens=4, ignore_eos=True).token_ids) == 4


def test_embedded_redis_requires_the_password(cluster: Cluster, tmp_path: Path) -> None:
    anonymous = redis.Redis.from_url(cluster.redis_url)
    with anonymous, pytest.raises(redis.AuthenticationError):
        anonymous.ping()
    settings = cluster.redis_settings
    assert settings is not None and settings.password
    # `tandem ledger audit` reaches both with the files an operator would give it.
    (tmp_path / "redis").write_text(settings.password)
    (tmp_path / "secret").write_text(cluster.cluster_secret or "")
    command = [sys.executable, "-m", "tandem_client", "ledger", "audit", "--redis-url"]
    command += [cluster.redis_url, "--redis-password-file", str(tmp_path / "redis")]
    audit = subprocess.run(
        [*command, "--cluster-secret-file", str(tmp_path / "secret")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert audit.returncode == 0, audit.stdout + audit.stderr
    assert "0 discrepancies, 2 of 2 workers audited" in audit.stdout
    without_secret = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert without_secret.returncode == 1
    assert "UNAUTHENTICATED" in without_secret.stdout

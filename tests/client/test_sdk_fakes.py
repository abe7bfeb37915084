"""The SDK against small in-process gRPC servers that answer what a test needs: retries of
UNAVAILABLE (before the first chunk only), status codes to exceptions, the bearer token,
mTLS, and request building (keywords checked before any call). The SDK against a real
cluster: test_sdk.py."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_type_hints

import grpc
import pytest
from grpc_health.v1 import health, health_pb2_grpc

from tandem.v1 import generation_pb2 as gen
from tandem.v1 import generation_pb2_grpc as gen_grpc
from tandem_client import (
    AsyncTandemClient,
    Cancelled,
    DeadlineExceeded,
    InvalidRequest,
    NotFound,
    Overloaded,
    SamplingKwargs,
    TandemClient,
    TandemError,
    Tls,
    Unauthenticated,
    Unavailable,
    connection,
)
from tandem_client.errors import error_for
from tandem_client.request import SAMPLING_FIELDS, build_request

TOKENS = [5, 6, 7, 8]


@dataclass
class FakeGeneration(gen_grpc.GenerationServicer):  # type: ignore[misc]
    """Answers each Generate with the next status in ``answers`` (None: streams TOKENS in
    two chunks; "midway": the first chunk, then UNAVAILABLE), then streams."""

    answers: list[grpc.StatusCode | str | None] = field(default_factory=list)
    calls: list[dict[str, str]] = field(default_factory=list)  # each call's metadata

    def Generate(self, request: gen.GenerateRequest, context: Any) -> Iterator[gen.GenerateChunk]:
        self.calls.append(dict(context.invocation_metadata()))
        answer = self.answers.pop(0) if self.answers else None
        if isinstance(answer, grpc.StatusCode):
            context.abort(answer, f"fake {answer.name}")
        yield gen.GenerateChunk(request_id="r1", index=0, token_ids=TOKENS[:2], text="ab")
        if answer == "midway":
            context.abort(grpc.StatusCode.UNAVAILABLE, "fake: lost mid-stream")
        spec = gen.SpeculativeUsage(num_drafts=1, num_draft_tokens=3, num_accepted_tokens=1)
        yield gen.GenerateChunk(
            request_id="r1",
            index=2,
            token_ids=TOKENS[2:],
            text="cd",
            finish_reason=gen.FINISH_REASON_LENGTH,
            usage=gen.Usage(prompt_tokens=3, completion_tokens=4, speculative=spec),
        )

    def ListModels(self, request: gen.ListModelsRequest, context: Any) -> gen.ListModelsResponse:
        self.calls.append(dict(context.invocation_metadata()))
        return gen.ListModelsResponse(models=[gen.ModelInfo(name="tiny", max_model_len=256)])


@dataclass
class Server:
    address: str
    servicer: FakeGeneration


def serve(servicer: FakeGeneration, credentials: Any = None) -> tuple[Any, str]:
    server = grpc.server(ThreadPoolExecutor(4))
    gen_grpc.add_GenerationServicer_to_server(servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    if credentials is None:
        port = server.add_insecure_port("127.0.0.1:0")
    else:
        port = server.add_secure_port("127.0.0.1:0", credentials)
    server.start()
    return server, f"127.0.0.1:{port}"


@pytest.fixture
def fake() -> Iterator[Server]:
    servicer = FakeGeneration()
    server, address = serve(servicer)
    yield Server(address, servicer)
    server.stop(None)


@pytest.fixture
def closed_address() -> str:
    """A loopback port nothing listens on: connections are refused at once."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{sock.getsockname()[1]}"


@pytest.fixture
def longest_pauses(monkeypatch: pytest.MonkeyPatch) -> None:
    """Full jitter at its top: every pause is the full backoff (timings become exact)."""
    monkeypatch.setattr(connection.random, "uniform", lambda low, high: high)


def test_sampling_keywords_are_the_wire_fields() -> None:
    assert set(get_type_hints(SamplingKwargs)) == SAMPLING_FIELDS


def test_unknown_keyword_is_a_type_error_before_any_call(fake: Server) -> None:
    with TandemClient(fake.address) as client:
        with pytest.raises(TypeError, match="'max_token'"):
            client.stream("hi", max_token=3)  # type: ignore[call-arg]
        with pytest.raises(TypeError, match="'tempreature'"):
            client.generate("hi", tempreature=0.0)  # type: ignore[call-arg]
        with pytest.raises(InvalidRequest, match="max_tokens") as raised:
            client.generate("hi", max_tokens=-1)
        assert raised.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert fake.servicer.calls == []


def test_requests_carry_each_prompt_form_and_the_sampling_keywords() -> None:
    chat = build_request([{"role": "user", "content": "hi"}], stop="x", seed=3, logprobs=2)
    assert chat.WhichOneof("prompt") == "chat" and chat.chat.messages[0].content == "hi"
    assert list(chat.sampling.stop) == ["x"] and chat.sampling.seed == 3
    assert chat.sampling.HasField("logprobs") and not chat.sampling.HasField("temperature")
    ids = build_request([], request_id="a1", temperature=0.0, stop_token_ids=[2])
    assert ids.WhichOneof("prompt") == "token_ids" and ids.request_id == "a1"
    assert ids.sampling.HasField("temperature") and list(ids.sampling.stop_token_ids) == [2]
    assert build_request("hi").text == "hi"


def test_sync_generate_joins_chunks_and_sends_the_bearer_token(fake: Server) -> None:
    with TandemClient(fake.address, token="s3cret") as client:
        answer = client.generate([1, 2, 3], max_tokens=4)
        assert client.models()[0].name == "tiny"
        assert client.health() == "SERVING"
    assert answer.token_ids == tuple(TOKENS) and answer.text == "abcd"
    assert answer.finish_reason == "length" and answer.logprobs is None
    assert answer.usage is not None and answer.usage.speculative is not None
    assert answer.usage.speculative.num_draft_tokens == 3
    assert [c["authorization"] for c in fake.servicer.calls] == ["Bearer s3cret"] * 2


async def test_async_stream_sends_the_bearer_token(fake: Server) -> None:
    async with AsyncTandemClient(fake.address, token="s3cret") as client:
        chunks = [c async for c in client.stream("hi")]
        assert (await client.models())[0].max_model_len == 256
        assert await client.health() == "SERVING"
    assert [c.index for c in chunks] == [0, 2] and chunks[-1].usage is not None
    assert [c["authorization"] for c in fake.servicer.calls] == ["Bearer s3cret"] * 2


def test_sync_retries_unavailable_before_the_first_chunk(
    fake: Server, longest_pauses: None
) -> None:
    fake.servicer.answers = [grpc.StatusCode.UNAVAILABLE] * 2
    started = time.monotonic()
    with TandemClient(fake.address, max_retries=2, backoff_s=0.1) as client:
        assert client.generate("hi").token_ids == tuple(TOKENS)
    assert len(fake.servicer.calls) == 3
    assert time.monotonic() - started >= 0.1 + 0.2  # full pauses: 0.1 s, then 0.2 s


async def test_async_retries_unavailable_before_the_first_chunk(fake: Server) -> None:
    fake.servicer.answers = [grpc.StatusCode.UNAVAILABLE] * 2
    async with AsyncTandemClient(fake.address, max_retries=2, backoff_s=0.01) as client:
        assert (await client.generate("hi")).text == "abcd"
    assert len(fake.servicer.calls) == 3


async def test_retries_run_out(fake: Server) -> None:
    fake.servicer.answers = [grpc.StatusCode.UNAVAILABLE] * 3
    async with AsyncTandemClient(fake.address, max_retries=2, backoff_s=0.01) as client:
        with pytest.raises(Unavailable, match="fake UNAVAILABLE") as raised:
            await client.generate("hi")
    assert raised.value.message == "fake UNAVAILABLE"
    assert len(fake.servicer.calls) == 3


def test_sync_no_retry_after_a_token(fake: Server) -> None:
    fake.servicer.answers = ["midway"]
    with TandemClient(fake.address, backoff_s=0.01) as client:
        seen = []
        with pytest.raises(Unavailable, match="mid-stream"):
            for chunk in client.stream("hi"):
                seen.append(chunk)
    assert len(seen) == 1 and len(fake.servicer.calls) == 1


async def test_async_no_retry_after_a_token(fake: Server) -> None:
    fake.servicer.answers = ["midway"]
    async with AsyncTandemClient(fake.address, backoff_s=0.01) as client:
        with pytest.raises(Unavailable, match="mid-stream"):
            await client.generate("hi")
    assert len(fake.servicer.calls) == 1


@pytest.mark.parametrize(
    ("code", "error"),
    [
        (grpc.StatusCode.RESOURCE_EXHAUSTED, Overloaded),
        (grpc.StatusCode.INVALID_ARGUMENT, InvalidRequest),
        (grpc.StatusCode.OUT_OF_RANGE, InvalidRequest),
        (grpc.StatusCode.PERMISSION_DENIED, Unauthenticated),
        (grpc.StatusCode.UNAUTHENTICATED, Unauthenticated),
        (grpc.StatusCode.NOT_FOUND, NotFound),
        (grpc.StatusCode.INTERNAL, TandemError),
    ],
)
def test_status_codes_become_exceptions_without_retry(
    fake: Server, code: grpc.StatusCode, error: type[TandemError]
) -> None:
    """Overloaded here comes from a fake: provoking RESOURCE_EXHAUSTED from a real router
    takes a full cluster (every decode worker out of blocks past a deadline)."""
    fake.servicer.answers = [code]
    with TandemClient(fake.address, backoff_s=0.01) as client, pytest.raises(error) as raised:
        client.generate("hi")
    assert type(raised.value) is error
    assert raised.value.code == code and raised.value.message == f"fake {code.name}"
    assert len(fake.servicer.calls) == 1


def test_every_code_maps_to_a_tandem_error() -> None:
    assert isinstance(error_for(grpc.StatusCode.CANCELLED, "x"), Cancelled)
    assert isinstance(error_for(grpc.StatusCode.DEADLINE_EXCEEDED, "x"), DeadlineExceeded)
    for code in grpc.StatusCode:
        assert isinstance(error_for(code, "x"), TandemError)


def test_sync_unavailable_at_a_closed_port_after_retries(
    closed_address: str, longest_pauses: None
) -> None:
    started = time.monotonic()
    with TandemClient(closed_address, max_retries=3, backoff_s=0.1) as client:
        with pytest.raises(Unavailable):
            client.generate("hi")
        with pytest.raises(Unavailable):
            client.health()
    # Each call paused 0.1 + 0.2 + 0.4 s between its four attempts.
    assert 2 * 0.7 <= time.monotonic() - started < 10


async def test_async_unavailable_at_a_closed_port_after_retries(
    closed_address: str, longest_pauses: None
) -> None:
    started = time.monotonic()
    async with AsyncTandemClient(closed_address, max_retries=3, backoff_s=0.1) as client:
        with pytest.raises(Unavailable):
            await client.generate("hi")
    assert 0.7 <= time.monotonic() - started < 5


async def test_retries_stop_at_the_deadline(closed_address: str, longest_pauses: None) -> None:
    """The deadline bounds the whole call: no pause runs past it."""
    started = time.monotonic()
    async with AsyncTandemClient(closed_address, max_retries=10, backoff_s=0.2) as client:
        with pytest.raises(Unavailable):
            await client.generate("hi", timeout=1.0)
    assert time.monotonic() - started < 1.0


def test_mutual_tls(tmp_path: Path) -> None:
    trustme = pytest.importorskip("trustme", reason="trustme: pip install -e '.[dev]'")
    ca = trustme.CA()
    server_cert = ca.issue_cert("tandem-router")
    client_cert = ca.issue_cert("tandem-client")
    credentials = grpc.ssl_server_credentials(
        [
            (
                server_cert.private_key_pem.bytes(),
                b"".join(p.bytes() for p in server_cert.cert_chain_pems),
            )
        ],
        root_certificates=ca.cert_pem.bytes(),
        require_client_auth=True,
    )
    servicer = FakeGeneration()
    server, address = serve(servicer, credentials)
    (tmp_path / "client.key").write_bytes(client_cert.private_key_pem.bytes())
    tls = Tls(
        root_certificates=ca.cert_pem.bytes(),
        certificate_chain=b"".join(p.bytes() for p in client_cert.cert_chain_pems),
        private_key=tmp_path / "client.key",  # a path is read
        server_name="tandem-router",
    )
    try:
        with TandemClient(address, tls=tls, token="t") as client:
            assert client.generate("hi").text == "abcd"
        assert servicer.calls[0]["authorization"] == "Bearer t"
        no_cert = Tls(root_certificates=ca.cert_pem.bytes(), server_name="tandem-router")
        # Without a client certificate the handshake fails: no call reaches the server.
        client = TandemClient(address, tls=no_cert, max_retries=0)
        with client, pytest.raises(Unavailable):
            client.models(timeout=5)
        assert len(servicer.calls) == 1
    finally:
        server.stop(None)
    with pytest.raises(ValueError, match="both"):
        Tls(certificate_chain=b"x")

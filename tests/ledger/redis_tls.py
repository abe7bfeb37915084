"""What the TLS and ACL Redis tests share: certificates from trustme, a restricted ACL
user's rules, and the `tandem` command line run in a fresh interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from ledger.redis_connect import PASSWORD_ENV

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Certs:
    ca: Path  # the trustme CA's certificate
    server: Path  # certificate for 127.0.0.1 and its key, one PEM
    client: Path  # client certificate and its key, one PEM


def issue_certs(directory: Path) -> Certs:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, as PEM files in
    ``directory``; skips the test without trustme (a dev extra)."""
    trustme = pytest.importorskip("trustme", reason="trustme: pip install -e '.[dev]'")
    ca = trustme.CA()
    certs = Certs(directory / "ca.pem", directory / "server.pem", directory / "client.pem")
    ca.cert_pem.write_to_path(str(certs.ca))
    ca.issue_cert("127.0.0.1").private_key_and_cert_chain_pem.write_to_path(str(certs.server))
    ca.issue_cert("tandem-client").private_key_and_cert_chain_pem.write_to_path(str(certs.client))
    return certs


def ledger_acl(user: str, password: str, namespace: str) -> str:
    """What the ledger needs, and no more: its namespace's keys; TIME is called by its
    scripts. An ACL ``user`` line without the word "user"."""
    return (
        f"{user} on >{password} resetkeys ~{namespace}:* resetchannels -@all "
        "+@read +@write +@scripting +ping +time -@dangerous"
    )


def run_tandem(*args: str, cwd: Path, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    """`tandem ARGS` in a fresh interpreter, importing this checkout, with no password in
    its environment."""
    env = {k: v for k, v in os.environ.items() if k != PASSWORD_ENV}
    paths = [str(REPO), str(REPO / "client"), env.get("PYTHONPATH")]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, paths))
    command = [sys.executable, "-m", "tandem_client", *args]
    return subprocess.run(
        command, capture_output=True, text=True, timeout=timeout_s, cwd=cwd, env=env
    )

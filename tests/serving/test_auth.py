"""serving.auth without a cluster: which binds warn, credential files, and the
interceptors' check of the metadata (constant-time, exact)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from serving.auth import (
    CLUSTER_SECRET_ENV,
    AuthConfigError,
    bearer_interceptor,
    cluster_interceptor,
    cluster_metadata,
    cluster_secret_from_args,
    exposure_warning,
    is_loopback,
    read_secret_file,
)
from serving.cli import exposure_warnings
from serving.launcher import ClusterSpec


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "localhost", "::1", "[::1]"])
def test_loopback_binds_never_warn(host: str) -> None:
    assert is_loopback(host)
    options = "--auth-token-file PATH"
    assert exposure_warning("router", host, 50050, is_authenticated=False, options=options) is None


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "", "10.1.2.3", "example.com"])
def test_a_non_loopback_bind_without_auth_warns(host: str) -> None:
    assert not is_loopback(host)
    options = "--auth-token-file PATH"
    line = exposure_warning("the router", host, 50050, is_authenticated=False, options=options)
    assert line is not None and "\n" not in line
    assert f"{host}:50050" in line and "--auth-token-file PATH" in line
    assert exposure_warning("r", host, 1, is_authenticated=True, options=options) is None


def test_serve_warns_for_the_router_and_workers_apart(tmp_path: Path) -> None:
    assert exposure_warnings(ClusterSpec(model="m")) == []
    exposed = exposure_warnings(ClusterSpec(model="m", host="0.0.0.0"))
    assert len(exposed) == 1 and "the router at 0.0.0.0:50050:" in exposed[0]
    both = exposure_warnings(ClusterSpec(model="m", host="0.0.0.0", worker_host="0.0.0.0"))
    assert len(both) == 2 and "the workers at 0.0.0.0:*" in both[1]
    authed = ClusterSpec(model="m", host="0.0.0.0", auth_token_file=tmp_path / "token")
    assert exposure_warnings(authed) == []


def test_credential_files(tmp_path: Path) -> None:
    (tmp_path / "token").write_text("abc\n")
    assert read_secret_file(tmp_path / "token", "--auth-token-file") == "abc"
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(AuthConfigError, match="--auth-token-file"):
        read_secret_file(tmp_path / "empty", "--auth-token-file")
    with pytest.raises(AuthConfigError, match="cannot read"):
        read_secret_file(tmp_path / "missing", "--cluster-secret-file")
    args = argparse.Namespace(cluster_secret_file=None)
    assert cluster_secret_from_args(args, {}) is None
    assert cluster_secret_from_args(args, {CLUSTER_SECRET_ENV: "env"}) == "env"
    args.cluster_secret_file = str(tmp_path / "token")
    assert cluster_secret_from_args(args, {CLUSTER_SECRET_ENV: "env"}) == "abc"
    assert cluster_metadata(None) == ()


def test_interceptors_check_the_exact_value() -> None:
    bearer = bearer_interceptor(["tandem.v1.Generation"], "tok")
    assert bearer.is_allowed([("authorization", "Bearer tok")])
    for sent in ([], [("authorization", "Bearer to")], [("authorization", "tok")], None):
        assert not bearer.is_allowed(sent)
    cluster = cluster_interceptor(["tandem.v1.DecodeWorker"], "s")
    assert cluster.is_allowed(cluster_metadata("s"))
    assert not cluster.is_allowed(cluster_metadata("t"))

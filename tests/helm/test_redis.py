"""The bundled Redis's command, as rendered, run against a real redis-server: it requires
the password from its Secret's file (never on a command line) and is the container's
first process, so SIGTERM stops it."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from tests.helm.chart import rendered

pytest.importorskip("helm_python", reason="helm-python-sdk (dev extra) is not installed")


def test_bundled_redis_requires_the_password_and_stops_on_sigterm(tmp_path: Path) -> None:
    import redis

    from ledger.redis_server import free_port, redis_server_binary

    statefulset = yaml.safe_load(rendered("default")["tandem/templates/redis-statefulset.yaml"])
    (container,) = statefulset["spec"]["template"]["spec"]["containers"]
    assert container["command"][:2] == ["sh", "-c"]
    script = container["command"][2]
    (password_mount,) = [m for m in container["volumeMounts"] if m["name"] == "redis-auth"]
    password_file = f"{password_mount['mountPath']}/password"
    assert password_file in script and "requirepass" in script

    (tmp_path / "password").write_text("s3cret-Pw")
    local = script.replace(password_file, str(tmp_path / "password"))
    local = local.replace("dir /data", f"dir {tmp_path}")
    local = local.replace("exec redis-server", f"exec {redis_server_binary()}")
    port = free_port()
    env = {"PATH": os.environ["PATH"], "REDIS_PORT": str(port)}
    proc = subprocess.Popen(["sh", "-c", local], env=env, stdout=subprocess.DEVNULL)
    try:
        client = redis.Redis(port=port, password="s3cret-Pw", socket_timeout=5)
        for _ in range(100):
            try:
                assert client.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.05)
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port, socket_timeout=5).set("k", "v")
        assert client.config_get("appendonly") == {"appendonly": "no"}
        assert Path(f"/proc/{proc.pid}/comm").read_text().strip() == "redis-server"
        assert "s3cret" not in Path(f"/proc/{proc.pid}/cmdline").read_text()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    finally:
        proc.kill()
        proc.wait()

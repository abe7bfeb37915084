"""The chart's commands run: the co-located value set rendered, then its bundled Redis,
router and co-located prefill and decode workers started here as processes with exactly
the rendered arguments (only pod paths, addresses and ports mapped to this machine) and
the credentials from the rendered Secrets. The cluster serves, refuses clients without
the token, and every process drains and exits 0 on SIGTERM."""

from __future__ import annotations

import base64
import os
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.helm.chart import FIELD_VALUES, by_kind, expand_args, pod_containers, render_raw

pytest.importorskip("helm_python", reason="helm-python-sdk (dev extra) is not installed")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

GRACE_S = 5
VALUES: dict[str, Any] = {
    "engine": {"dtype": "float32", "blockSize": 4},
    "model": {
        "source": "hostPath",
        "hostPath": {"path": "/srv/models"},
        "path": "target",
        "servedName": "target",
    },
    "router": {"threads": 1, "drain": {"graceSeconds": GRACE_S}},
    "prefill": {"engine": {"threads": 1, "kvCacheMemory": 16 << 20}},
    "decode": {"engine": {"threads": 1, "kvCacheMemory": 16 << 20}},
    "colocated": {"enabled": True},
}
PROMPT = [5, 9, 14, 3, 22]


def objects() -> list[dict[str, Any]]:
    texts = [t for path, t in render_raw(VALUES).items() if not path.endswith("NOTES.txt")]
    return [d for t in texts for d in yaml.safe_load_all(t) if d]


class Rewriter:
    """Maps a pod's paths, addresses and ports to this machine's."""

    def __init__(self, root: Path, models: Path, redis_port: int) -> None:
        from ledger.redis_server import free_port

        self.root, self.models, self.redis_port = root, models, redis_port
        self.ports: dict[str, int] = {}
        self._free_port = free_port

    def port(self, rendered: str) -> int:
        return self.ports.setdefault(rendered, self._free_port())

    def arg(self, arg: str) -> str:
        option, _, value = arg.partition("=")
        if option in ("--port", "--metrics-port", "--http-port"):
            return f"{option}={self.port(value)}"
        if option in ("--host", "--metrics-host"):
            return f"{option}=127.0.0.1"
        if option == "--redis-url":
            return f"{option}=redis://127.0.0.1:{self.redis_port}/0"
        arg = arg.replace("=/models/", f"={self.models}/")
        return arg.replace("=/etc/tandem/", f"={self.root}/etc/")


def write_secrets(objs: list[dict[str, Any]], root: Path) -> dict[str, str]:
    """The rendered Secrets' keys as the pods mount them (items: key -> path)."""
    data = {s["metadata"]["name"]: s["data"] for s in objs if s["kind"] == "Secret"}
    values = {}
    for mount, (secret, key) in {
        "auth/token": ("demo-tandem-auth", "token"),
        "auth/cluster-secret": ("demo-tandem-auth", "cluster-secret"),
        "redis/password": ("demo-tandem-redis", "password"),
    }.items():
        value = base64.b64decode(data[secret][key]).decode()
        path = root / "etc" / mount
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(value)
        values[mount] = value
    return values


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    from ledger.redis_server import free_port, redis_server_binary
    from tests.services.cluster_helpers import build_tiny_target

    root = tmp_path_factory.mktemp("rendered")
    build_tiny_target(root / "models" / "target")
    objs = objects()
    secrets = write_secrets(objs, root)
    redis_port = free_port()
    rewrite = Rewriter(root, root / "models", redis_port)
    maps = {o["metadata"]["name"]: o["data"] for o in objs if o["kind"] == "ConfigMap"}
    fields = {**FIELD_VALUES, "status.podIP": "127.0.0.1"}
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    procs: dict[str, subprocess.Popen[bytes]] = {}
    logs = root / "logs"
    logs.mkdir()

    (redis_set,) = by_kind(objs, "StatefulSet").values()
    (redis_container,) = pod_containers(redis_set)
    script = redis_container["command"][2]
    script = script.replace("/etc/redis-auth/password", str(root / "etc" / "redis" / "password"))
    script = script.replace("dir /data", f"dir {root}")
    script = script.replace("exec redis-server", f"exec {redis_server_binary()}")
    procs["redis"] = subprocess.Popen(
        ["sh", "-c", script], env={**env, "REDIS_PORT": str(redis_port)}, stdout=subprocess.DEVNULL
    )
    tandem = shutil.which("tandem")
    assert tandem is not None
    deployments = by_kind(objs, "Deployment")
    try:
        for component in ("worker", "router"):
            for container in pod_containers(deployments[component]):
                argv = [rewrite.arg(a) for a in expand_args(container, maps, fields)]
                with (logs / f"{container['name']}.log").open("wb") as log:
                    procs[container["name"]] = subprocess.Popen(
                        [tandem, *argv], env=env, stdout=log, stderr=subprocess.STDOUT
                    )
        yield {"procs": procs, "rewrite": rewrite, "secrets": secrets, "logs": logs}
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait()


def test_rendered_cluster_serves_with_the_charts_credentials_and_drains(
    cluster: dict[str, Any],
) -> None:
    from tandem_client import TandemClient, Unauthenticated

    rewrite, procs, token = cluster["rewrite"], cluster["procs"], cluster["secrets"]["auth/token"]
    router = f"127.0.0.1:{rewrite.port('50050')}"
    with TandemClient(router, token=token, timeout=60) as client:
        deadline = time.monotonic() + 180
        while not _serves(client):
            for name, proc in procs.items():
                log = cluster["logs"] / f"{name}.log"
                tail = log.read_text()[-2000:] if log.exists() else ""
                assert proc.poll() is None, f"{name} exited {proc.returncode}: {tail}"
            assert time.monotonic() < deadline, "the rendered cluster did not serve in 180 s"
            time.sleep(0.5)
        answer = client.generate(PROMPT, max_tokens=6, temperature=0.0)
        assert len(answer.token_ids) == 6 and answer.finish_reason == "length"
    with TandemClient(router, timeout=30) as anonymous, pytest.raises(Unauthenticated):
        anonymous.generate(PROMPT, max_tokens=2)
    http = f"http://127.0.0.1:{rewrite.port('8000')}/v1/models"
    request = urllib.request.Request(http, headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(request, timeout=30) as reply:
        assert b'"target"' in reply.read()
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(http, timeout=30)
    assert refused.value.code == 401
    for port in ("9090", "9091", "9092"):  # each component's /metrics on its own port
        url = f"http://127.0.0.1:{rewrite.port(port)}/metrics"
        with urllib.request.urlopen(url, timeout=30) as reply:
            assert b"tandem_" in reply.read()

    for name in ("router", "prefill", "decode", "redis"):  # SIGTERM: a drain, then exit 0
        procs[name].send_signal(signal.SIGTERM)
        assert procs[name].wait(timeout=GRACE_S + 30) == 0, name


def _serves(client: Any) -> bool:
    """SERVING, with a prefill and a decode worker registered (a one-token request goes
    through)."""
    try:
        if client.health(timeout=5) != "SERVING":
            return False
        client.generate(PROMPT, max_tokens=1, temperature=0.0, timeout=10)
    except Exception:
        return False
    return True

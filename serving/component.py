"""One bootstrap for every Tandem process (router, prefill worker, decode worker): the
gRPC server, metrics, the ledger and membership, then serving until SIGTERM, SIGINT or
the launcher's exit, and a graceful drain. Each role's cli.py declares its options and
how to build its service; the rest is here.

Imports neither torch nor the engine: the router starts through this module too.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from ledger.ledger import Ledger, WorkerRole
from ledger.membership import Component, Membership, Timing
from ledger.redis_connect import RedisSettings, connect
from serving.metrics import Metrics
from serving.rpc import (
    advertised_address,
    default_worker_id,
    new_server,
    run_service,
    set_serving,
    wait_for_shutdown,
)


class Service(Component, Protocol):
    """What the bootstrap runs: a Component (membership's side) that also serves gRPC."""

    served_name: str  # the model, as clients name it

    def add_to(self, server: Any) -> None:
        """Adds its servicers to the (not yet started) gRPC server."""
        ...

    def start(self) -> None:
        """Starts what must run before the port opens (the engine thread)."""
        ...

    async def housekeeping(self) -> None:
        """Runs in the background while serving (lease reaping, lapsed reservations)."""
        ...

    async def drain(self, timeout_s: float) -> None:
        """Refuses new requests and waits, at most ``timeout_s``, for those in flight."""
        ...

    async def close(self) -> None:
        """Stops and frees what ``start`` and serving opened (engine thread, channels)."""
        ...


@dataclass(frozen=True)
class Role:
    """What differs between the processes that this bootstrap starts."""

    name: str  # "router", "prefill", "decode": the log's tag, the default id's prefix
    title: str  # "router", "prefill worker", ...: the "serving" log line's subject
    logger: str  # the logger of the start-up lines
    worker_role: WorkerRole
    service_names: tuple[str, ...]  # health (and reflection) names
    make_metrics: Callable[[], Metrics]
    max_message_bytes: Callable[[argparse.Namespace], int]


@dataclass
class Runtime:
    """What a role's ``make_service`` builds its service from."""

    role: Role
    args: argparse.Namespace
    address: str  # where others reach this process
    metrics: Any  # the role's Metrics subclass
    ledger: Ledger
    membership: Membership | None = None

    def new_membership(self, capacity: int) -> Membership:
        """This process's membership, with ``capacity`` KV blocks. The bootstrap registers
        it (a fresh epoch, the fencing token) once the service is built, so that the
        registration need not outlive the engine's and the service's construction."""
        args = self.args
        self.membership = Membership(
            self.ledger,
            args.worker_id or default_worker_id(self.role.name, self.address),
            role=self.role.worker_role,
            address=self.address,
            capacity=capacity,
            timing=Timing(args.heartbeat_ms, args.lease_ms),
        )
        return self.membership


MakeService = Callable[[Runtime], Service]


def run_component(role: Role, args: argparse.Namespace, make_service: MakeService) -> int:
    """A process's body: serves until shutdown; the exit code (1: Redis unreachable)."""

    async def serve(args: argparse.Namespace) -> None:
        await _serve(role, args, make_service)

    return run_service(role.name, serve, args)


async def _serve(role: Role, args: argparse.Namespace, make_service: MakeService) -> None:
    log = logging.getLogger(role.logger)
    reflected: Sequence[str] = role.service_names if args.reflection else ()
    server, health = new_server(role.max_message_bytes(args), reflected)
    port = server.add_insecure_port(f"{args.host}:{args.port}")
    address = advertised_address(args, port)
    metrics = role.make_metrics()
    metrics.serve(args.host, args.metrics_port)
    client = metrics.instrument_redis(connect(RedisSettings.from_args(args)))
    runtime = Runtime(role, args, address, metrics, Ledger(client, namespace=args.namespace))
    service = make_service(runtime)
    metrics.watch_loop()  # from here: building the engine above holds the loop by design
    membership = runtime.membership
    if membership is None:
        raise RuntimeError(f"{role.name}: make_service made no membership")
    membership.attach(service)
    membership.register()
    service.add_to(server)
    service.start()
    await server.start()
    membership.start()
    housekeeping = asyncio.create_task(service.housekeeping(), name=f"{role.name}-housekeeping")
    await set_serving(health, role.service_names)
    name = service.served_name
    log.info("%s %s serving %s at %s", role.title, membership.worker_id, name, address)
    reason = await wait_for_shutdown(args.parent_pid)
    log.info("draining (%s)", reason)
    await health.enter_graceful_shutdown()
    await service.drain(args.grace_s)
    await server.stop(1.0)
    housekeeping.cancel()
    await membership.stop()
    await service.close()
    metrics.close()
    log.info("stopped")

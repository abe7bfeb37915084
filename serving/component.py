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
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from ledger.ledger import Ledger, WorkerRole
from ledger.membership import Component, Membership, Timing
from ledger.redis_connect import RedisSettings, connect
from serving.auth import (
    auth_token_from_args,
    bearer_interceptor,
    cluster_interceptor,
    cluster_metadata,
    cluster_secret_from_args,
    exposure_warning,
)
from serving.liveness import watch_engine, watch_readiness
from serving.metrics import Metrics
from serving.rpc import (
    NOT_SERVING,
    ChannelPool,
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
    is_public: bool = False  # clients call it (the bearer token), not only the cluster
    # Workers: whether the service's engine lives (serving.liveness); health follows it.
    is_alive: Callable[[Any, argparse.Namespace], bool] | None = None
    # The router: whether it can serve now (a warm worker pair); the server's overall
    # health follows it, the role's services stay SERVING while the process works.
    is_ready: Callable[[Any], bool] | None = None


@dataclass
class Runtime:
    """What a role's ``make_service`` builds its service from."""

    role: Role
    args: argparse.Namespace
    address: str  # where others reach this process
    metrics: Any  # the role's Metrics subclass
    ledger: Ledger
    membership: Membership | None = None
    auth_token: str | None = None  # the bearer token clients must send (a public role)
    cluster_secret: str | None = None  # what internal calls carry and workers require

    def channel_pool(self) -> ChannelPool:
        """Channels to workers: every call carries the cluster secret, if any."""
        return ChannelPool(cluster_metadata(self.cluster_secret), self.args.keepalive_ms)

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
    token = auth_token_from_args(args) if role.is_public else None
    secret = cluster_secret_from_args(args)
    auth = []
    if token is not None:
        auth.append(bearer_interceptor(role.service_names, token))
    if secret is not None and not role.is_public:
        auth.append(cluster_interceptor(role.service_names, secret))
    if args.keepalive_ms < 1000:
        raise SystemExit(f"--keepalive-ms: at least 1000, got {args.keepalive_ms}")
    server, health = new_server(role.max_message_bytes(args), reflected, auth, args.keepalive_ms)
    port = server.add_insecure_port(f"{args.host}:{args.port}")
    address = advertised_address(args, port)
    if args.parent_pid is None:  # run alone (the launcher warns for its children)
        _warn_if_exposed(role, args.host, port, token, secret)
    metrics = role.make_metrics()
    metrics.serve(args.metrics_host, args.metrics_port)
    client = metrics.instrument_redis(connect(RedisSettings.from_args(args)))
    runtime = Runtime(role, args, address, metrics, Ledger(client, namespace=args.namespace))
    runtime.auth_token, runtime.cluster_secret = token, secret
    service = make_service(runtime)
    metrics.watch_loop()  # from here: building the engine above holds the loop by design
    membership = runtime.membership
    if membership is None:
        raise RuntimeError(f"{role.name}: make_service made no membership")
    membership.attach(service)
    service.add_to(server)
    service.start()
    if role.is_ready is not None:
        await health.set("", NOT_SERVING)  # grpc's health servicer starts SERVING
    await server.start()
    # Registered once the port listens: a router waiting for workers picks one the moment
    # it appears in the registry, and must not find its port closed.
    membership.register()
    membership.start()
    housekeeping = asyncio.create_task(service.housekeeping(), name=f"{role.name}-housekeeping")
    watcher = None  # the task that keeps health true: readiness, or the engine's life
    if role.is_ready is not None:  # the overall status follows it, from NOT_SERVING
        is_ready = role.is_ready
        await set_serving(health, role.service_names, is_overall=False)
        watcher = asyncio.create_task(
            watch_readiness(lambda: is_ready(service), health, log),
            name=f"{role.name}-readiness",
        )
    else:
        await set_serving(health, role.service_names)
        if role.is_alive is not None:
            is_alive = role.is_alive
            watcher = asyncio.create_task(
                watch_engine(lambda: is_alive(service, args), health, role.service_names, log),
                name=f"{role.name}-liveness",
            )
    name = service.served_name
    log.info("%s %s serving %s at %s", role.title, membership.worker_id, name, address)
    reason = await wait_for_shutdown(args.parent_pid)
    log.info("draining (%s)", reason)
    if watcher is not None:
        watcher.cancel()
    await health.enter_graceful_shutdown()
    await service.drain(args.grace_s)
    await server.stop(1.0)
    housekeeping.cancel()
    await membership.stop()
    await service.close()
    metrics.close()
    log.info("stopped")


def _warn_if_exposed(
    role: Role, host: str, port: int, token: str | None, secret: str | None
) -> None:
    """One line on stderr for a server reachable beyond loopback without authentication."""
    if role.is_public:
        is_authenticated, options = token is not None, "--auth-token-file PATH"
    else:
        is_authenticated = secret is not None
        options = "--cluster-secret-file PATH (the same file on every component)"
    line = exposure_warning(
        role.title, host, port, is_authenticated=is_authenticated, options=options
    )
    if line is not None:
        print(line, file=sys.stderr, flush=True)

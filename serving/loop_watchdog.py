"""Event-loop watchdog: how late each component's asyncio loop runs what is due, and why
when it stalls.

A component's servicers, heartbeats and KV receiver share one asyncio loop. Whatever
holds it up delays all of them, and past the registration TTL the worker loses its
registration and every request it holds. A ticker task on the loop records how late each
tick runs (``tandem_event_loop_lag_seconds``). A daemon thread watches the ticks; when
none came for ``report_after_s`` it takes the loop thread's stack, once per stall. When
the loop runs again, the stall is logged with what the loop thread did meanwhile, from
the kernel's accounting of that thread (``/proc/self/task/TID/schedstat``: time on a CPU,
time runnable but waiting for one):

- ``computing``: it ran most of the stall: a call on the loop computed (the stack says
  which);
- ``descheduled``: it was runnable most of the stall but got no CPU: the machine is
  oversubscribed;
- ``waiting``: it slept: a synchronous wait in a call on the loop (the stack shows it), or
  another thread of the process held the GIL (then the process used CPU meanwhile).

Where schedstat is missing, only the process's CPU time is known, and the cause reads
``unknown``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)

TICK_S = 0.05
REPORT_AFTER_S = 0.5
MOST = 0.5  # of the stall: "ran most of it", "runnable most of it"


@dataclass(frozen=True)
class Stall:
    """One stall of the loop, in seconds: its length, the loop thread's time on a CPU and
    runnable without one (None where unknown), the process's CPU time (all threads)."""

    seconds: float
    loop_cpu_s: float | None
    loop_runnable_s: float | None
    process_cpu_s: float
    stack: str | None  # where the loop thread was mid-stall; None: the watcher did not look

    @property
    def cause(self) -> str:
        if self.loop_cpu_s is None or self.loop_runnable_s is None:
            return "unknown"
        if self.loop_cpu_s >= MOST * self.seconds:
            return "computing"
        if self.loop_runnable_s >= MOST * self.seconds:
            return "descheduled"
        return "waiting"


@dataclass(frozen=True)
class _Sample:
    at: float  # time.monotonic()
    process_cpu_s: float
    thread: tuple[float, float] | None  # the loop thread's (on CPU, runnable) seconds


class LoopWatchdog:
    """``start`` it on the loop it watches (from a coroutine); ``stop`` at the end."""

    def __init__(
        self,
        observe_lag: Callable[[float], None] | None = None,
        *,
        tick_s: float = TICK_S,
        report_after_s: float = REPORT_AFTER_S,
        on_stall: Callable[[Stall], None] | None = None,
    ) -> None:
        self.observe_lag = observe_lag
        self.tick_s, self.report_after_s = tick_s, report_after_s
        self.on_stall = on_stall or _log_stall
        self._lock = threading.Lock()
        self._loop_thread = 0
        self._schedstat: int | None = None  # an open fd, read again at each tick
        self._last = _Sample(time.monotonic(), time.process_time(), None)
        self._stack: str | None = None  # taken by the watcher during this stall
        self._stopping = threading.Event()
        self._task: asyncio.Task[None] | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._loop_thread = threading.get_ident()
        try:
            path = f"/proc/self/task/{threading.get_native_id()}/schedstat"
            self._schedstat = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            self._schedstat = None
        self._last = self._sample()
        self._task = asyncio.get_running_loop().create_task(self._tick(), name="loop-watchdog")
        self._thread = threading.Thread(target=self._watch, name="loop-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        if self._task is not None:
            self._task.cancel()
        if self._thread is not None:
            self._thread.join(timeout=1.0)
        if self._schedstat is not None:
            os.close(self._schedstat)
            self._schedstat = None

    def _sample(self) -> _Sample:
        thread = None
        if self._schedstat is not None:
            try:
                on_cpu_ns, runnable_ns, _ = os.pread(self._schedstat, 128, 0).split()
                thread = (int(on_cpu_ns) / 1e9, int(runnable_ns) / 1e9)
            except (OSError, ValueError):
                thread = None
        return _Sample(time.monotonic(), time.process_time(), thread)

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(self.tick_s)
            now = self._sample()
            with self._lock:
                last, self._last = self._last, now
                stack, self._stack = self._stack, None
            late = max(now.at - last.at - self.tick_s, 0.0)
            if self.observe_lag is not None:
                self.observe_lag(late)
            if late < self.report_after_s:
                continue
            loop_cpu = loop_runnable = None
            if now.thread is not None and last.thread is not None:
                loop_cpu = now.thread[0] - last.thread[0]
                loop_runnable = now.thread[1] - last.thread[1]
            process_cpu = now.process_cpu_s - last.process_cpu_s
            self.on_stall(Stall(late, loop_cpu, loop_runnable, process_cpu, stack))

    def _watch(self) -> None:
        """Takes the loop thread's stack once per stall, while it is held up."""
        while not self._stopping.wait(self.tick_s):
            with self._lock:
                late = time.monotonic() - self._last.at - self.tick_s
                if late < self.report_after_s or self._stack is not None:
                    continue
                frame = sys._current_frames().get(self._loop_thread)
                self._stack = "".join(traceback.format_stack(frame)) if frame else ""


_WHY = {
    "computing": "a call on the loop computed",
    "descheduled": "the loop thread was runnable but got no CPU (an oversubscribed machine)",
    "waiting": "the loop thread slept: a synchronous wait on the loop, or another thread "
    "held the GIL",
    "unknown": "no per-thread accounting here",
}


def _log_stall(stall: Stall) -> None:
    def seconds(value: float | None) -> str:
        return "?" if value is None else f"{value:.2f}"

    log.warning(
        "event loop stalled %.2f s: %s (%s; loop thread on CPU %s s, runnable %s s; process "
        "CPU %.2f s)%s",
        stall.seconds,
        stall.cause,
        _WHY[stall.cause],
        seconds(stall.loop_cpu_s),
        seconds(stall.loop_runnable_s),
        stall.process_cpu_s,
        f"; the loop thread was at:\n{stall.stack}" if stall.stack else "",
    )

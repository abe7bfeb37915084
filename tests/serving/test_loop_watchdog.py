"""The event-loop watchdog measures lag and tells a stall's cause from the kernel's
accounting of the loop thread: a call on the loop that computes, one that waits, another
thread holding the GIL, and a loop thread that gets no CPU on an oversubscribed core
(three spinning processes pinned beside it)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Awaitable, Callable, Iterator

import pytest

from serving.loop_watchdog import LoopWatchdog, Stall

pytestmark = pytest.mark.skipif(
    not os.path.exists("/proc/self/schedstat"), reason="needs Linux schedstat accounting"
)


def spin(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def stalled_sync_call() -> None:
    time.sleep(0.8)  # a synchronous wait on the loop thread, as a blocking client call


def stalled_computation() -> None:
    spin(0.8)


async def watch(body: Callable[[], Awaitable[None]]) -> tuple[list[float], list[Stall]]:
    lags: list[float] = []
    stalls: list[Stall] = []
    watchdog = LoopWatchdog(lags.append, report_after_s=0.4, on_stall=stalls.append)
    watchdog.start()
    try:
        await asyncio.sleep(0.3)  # ticks on time
        await body()
        await asyncio.sleep(0.2)  # the tick after the stall reports it
    finally:
        watchdog.stop()
    return lags, stalls


@pytest.mark.parametrize(
    ("call", "cause"), [(stalled_sync_call, "waiting"), (stalled_computation, "computing")]
)
async def test_a_call_that_holds_up_the_loop_is_reported_with_its_stack(
    call: Callable[[], None], cause: str
) -> None:
    async def on_the_loop() -> None:
        call()

    lags, stalls = await watch(on_the_loop)
    assert [s.cause for s in stalls] == [cause], stalls
    stall = stalls[0]
    assert 0.7 <= stall.seconds < 1.5
    assert stall.stack is not None and call.__name__ in stall.stack
    assert sum(lag >= 0.7 for lag in lags) == 1 and len(lags) >= 5


async def test_a_thread_holding_the_gil_leaves_the_loop_waiting_while_the_process_runs() -> None:
    def hold_gil() -> None:
        time.sleep(0.1)  # the loop goes back to waiting for events first
        spin(0.8)  # pure Python, with a switch interval longer than the spin

    async def other_thread() -> None:
        interval = sys.getswitchinterval()
        sys.setswitchinterval(2.0)
        try:
            thread = threading.Thread(target=hold_gil)
            thread.start()
            await asyncio.to_thread(thread.join)
        finally:
            sys.setswitchinterval(interval)

    _, stalls = await watch(other_thread)
    assert [s.cause for s in stalls] == ["waiting"], stalls
    assert stalls[0].process_cpu_s >= 0.5 * stalls[0].seconds


CHILD = textwrap.dedent(
    """
    import asyncio, json, os, sys, time
    from serving.loop_watchdog import LoopWatchdog

    async def main():
        stalls = []
        watchdog = LoopWatchdog(report_after_s=0.4, on_stall=stalls.append)
        watchdog.start()
        await asyncio.sleep(0.2)
        print("ready", flush=True)
        sys.stdin.readline()  # the spinners run: 0.3 CPU-s of work takes about 1.2 s
        end = time.thread_time() + 0.3
        while time.thread_time() < end:
            pass
        await asyncio.sleep(0.3)
        watchdog.stop()
        print(json.dumps([[s.cause, s.seconds, s.loop_cpu_s, s.loop_runnable_s] for s in stalls]))

    asyncio.run(main())
    """
)


@pytest.fixture
def one_cpu() -> Iterator[int]:
    """A CPU with three processes spinning on it until the test ends."""
    cpu = min(os.sched_getaffinity(0))
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(3)]
    try:
        for p in spinners:
            os.sched_setaffinity(p.pid, {cpu})
        yield cpu
    finally:
        for p in spinners:
            p.kill()
            p.wait()


def test_a_loop_thread_without_a_cpu_is_descheduled(one_cpu: int) -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=os.getcwd(),
    )
    try:
        os.sched_setaffinity(child.pid, {one_cpu})  # all its threads: they start later
        assert child.stdin is not None and child.stdout is not None
        assert child.stdout.readline().strip() == "ready"
        out, _ = child.communicate("go\n", timeout=30)
    finally:
        child.kill()
    stalls = json.loads(out.strip().splitlines()[-1])
    assert [s[0] for s in stalls] == ["descheduled"], stalls
    _, seconds, loop_cpu, loop_runnable = stalls[0]
    assert 0.25 <= loop_cpu <= 0.4 and loop_runnable >= 0.5 * seconds

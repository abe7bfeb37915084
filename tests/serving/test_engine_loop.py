"""EngineLoop: what leaves the engine thread is never ahead of the figures Stats reads."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Any

from serving.engine_loop import EngineLoop
from tests.serving.commands import Do


class SlowBlocks:
    """A block manager whose figures take a while to read, as on a loaded machine."""

    num_blocks = total_blocks = 8

    def __init__(self) -> None:
        self.free = 8

    @property
    def num_free_blocks(self) -> int:
        time.sleep(0.05)  # lets the event loop run whatever the thread already handed it
        return self.free


def engine_with(blocks: SlowBlocks, steps: list[int]) -> Any:
    """Just enough of LLMEngine: each step frees what ``steps`` says, until none are left."""

    def step() -> list[int]:
        blocks.free = steps.pop(0)
        return [blocks.free]

    return SimpleNamespace(
        block_manager=blocks,
        scheduler=SimpleNamespace(running=[], waiting=[], config=SimpleNamespace(max_num_seqs=4)),
        spec=None,
        has_unfinished_requests=lambda: bool(steps),
        step_deltas=step,
        wants_cost_refresh=lambda: False,
    )


async def test_a_caller_and_a_stream_never_see_figures_from_before_what_they_got() -> None:
    blocks = SlowBlocks()
    steps: list[int] = []
    seen_on_delivery: list[tuple[int, int]] = []  # (free after the step, free in stats)

    def deliver(free: Any) -> None:
        seen_on_delivery.append((free, loop.stats.num_free_blocks))

    loop = EngineLoop(
        engine_with(blocks, steps),
        asyncio.get_running_loop(),
        on_step=lambda engine, deltas: deltas[0],
        deliver=deliver,
        on_error=lambda error: None,
    )
    loop.start()
    try:

        def reserve() -> None:  # a call that takes blocks, then two steps that free them
            blocks.free = 3
            steps.extend([5, 8])

        await loop.call(Do(reserve))
        assert loop.stats.num_free_blocks == 3
        while len(seen_on_delivery) < 2:
            await asyncio.sleep(0.01)
        assert seen_on_delivery == [(5, 5), (8, 8)]
    finally:
        loop.stop()


async def test_an_idle_loop_refreshes_costs_while_wanted_then_waits_and_serves_calls() -> None:
    """With nothing to step, the loop gives adaptive speculation's cost refresh one turn
    at a time while it is wanted, then waits (no spinning). A call that arrives during a
    turn is served before the next turn; a turn that raises ends the refresh, not the
    loop."""
    import threading

    events: list[str] = []
    in_first_turn, release_first, done = threading.Event(), threading.Event(), threading.Event()
    engine = engine_with(SlowBlocks(), [])
    engine.wants_cost_refresh = lambda: engine.refresh is not None and events.count("turn") < 3
    engine.refresh = True

    def refresh_costs() -> float:
        events.append("turn")
        if len(events) == 1:
            in_first_turn.set()
            release_first.wait(10)
        if events.count("turn") == 3:
            done.set()
            raise RuntimeError("out of memory")  # the last turn fails
        return 0.01

    def stop_cost_refresh() -> None:
        engine.refresh = None

    engine.refresh_costs, engine.stop_cost_refresh = refresh_costs, stop_cost_refresh
    loop = EngineLoop(
        engine,
        asyncio.get_running_loop(),
        on_step=lambda engine, deltas: deltas,
        deliver=lambda payload: None,
        on_error=lambda error: None,
    )
    loop.start()
    try:
        assert await asyncio.to_thread(in_first_turn.wait, 10)
        call = loop.submit(Do(lambda: events.append("call")))
        release_first.set()
        await call
        assert await asyncio.to_thread(done.wait, 10)
        assert await loop.call(Do(lambda: "served")) == "served"  # the loop still serves
        assert events == ["turn", "call", "turn", "turn"] and engine.refresh is None
    finally:
        loop.stop()


async def test_the_thread_that_builds_the_engine_steps_it_and_keeps_its_torch_threads() -> None:
    """A worker builds its engine on a TorchThread and steps it there; the thread that
    asked (the asyncio loop's, in a worker) then runs its own torch work on one thread,
    while the torch thread keeps its own count (OpenMP's is per thread)."""
    import threading

    import torch

    from serving.engine_loop import TorchThread, confine_torch

    thread = TorchThread("test-engine")
    ran_on: list[int] = []

    def build() -> Any:
        torch.set_num_threads(2)
        ran_on.append(threading.get_ident())
        steps = [5]
        engine = engine_with(SlowBlocks(), steps)
        engine.step_deltas = lambda: ran_on.append(threading.get_ident()) or [steps.pop()]
        return engine

    def asker() -> tuple[int, int]:  # stands for the asyncio thread, not pytest's own
        engine = thread.call(build)
        confine_torch()
        here = torch.get_num_threads()
        there = thread.call(torch.get_num_threads)
        torch.set_num_threads(there)  # as it was, for the tests after this one
        asked.append(engine)
        return here, there

    asked: list[Any] = []
    counts: list[tuple[int, int]] = []
    other = threading.Thread(target=lambda: counts.append(asker()))
    other.start()
    other.join()
    assert counts == [(1, 2)]
    delivered = asyncio.Event()
    loop = EngineLoop(
        asked[0],
        asyncio.get_running_loop(),
        on_step=lambda engine, deltas: deltas,
        deliver=lambda payload: delivered.set(),
        on_error=lambda error: None,
        thread=thread,
    )
    loop.start()
    try:
        await asyncio.wait_for(delivered.wait(), 10)
    finally:
        loop.stop()
    assert len(ran_on) == 2 and ran_on[0] == ran_on[1] != threading.get_ident()
    assert not thread.is_alive()  # the loop was its last job


def test_a_build_that_raises_raises_in_the_caller() -> None:
    from serving.engine_loop import TorchThread

    thread = TorchThread("test-engine")

    def build() -> None:
        raise ValueError("no such model")

    try:
        thread.call(build)
    except ValueError as e:
        assert str(e) == "no such model"
    else:
        raise AssertionError("the build's error did not reach the caller")
    assert thread.call(lambda: 7) == 7  # and the thread goes on

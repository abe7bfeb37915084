"""A worker's health follows its engine: EngineLoop.is_alive turns False while one step
runs past the stall limit and when the thread is gone, and watch_engine turns the server's
and the role's health NOT_SERVING then, and SERVING again once the engine moves. A
router's overall health follows its readiness (watch_readiness)."""

from __future__ import annotations

import asyncio
import logging
import threading
from types import SimpleNamespace
from typing import Any

from serving.engine_loop import EngineLoop
from serving.liveness import watch_engine, watch_readiness
from serving.rpc import NOT_SERVING, SERVING
from tests.serving.commands import Do


def blocking_engine(release: threading.Event, steps: list[int]) -> Any:
    """Just enough of LLMEngine: each step waits for ``release`` (a stuck kernel)."""

    def step() -> list[int]:
        release.wait()
        steps.pop()
        return []

    return SimpleNamespace(
        block_manager=SimpleNamespace(num_blocks=4, total_blocks=4, num_free_blocks=4),
        scheduler=SimpleNamespace(running=[], waiting=[], config=SimpleNamespace(max_num_seqs=4)),
        spec=None,
        has_unfinished_requests=lambda: bool(steps),
        step_deltas=step,
        wants_cost_refresh=lambda: False,
    )


async def test_is_alive_while_steps_move_not_when_one_stalls_or_the_thread_is_gone() -> None:
    release = threading.Event()
    steps: list[int] = []
    loop = EngineLoop(
        blocking_engine(release, steps),
        asyncio.get_running_loop(),
        on_step=lambda engine, deltas: deltas,
        deliver=lambda payload: None,
        on_error=lambda error: None,
    )
    assert not loop.is_alive(stall_s=60)  # not started
    loop.start()
    try:
        assert loop.is_alive(stall_s=0.2)  # idle: alive however long it waits
        await asyncio.sleep(0.3)
        assert loop.is_alive(stall_s=0.2)
        await loop.call(Do(lambda: steps.append(1)))  # one step to run, which blocks
        await asyncio.sleep(0.3)
        assert loop.is_alive(stall_s=60) and not loop.is_alive(stall_s=0.2)
        release.set()
        while steps:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        assert loop.is_alive(stall_s=0.2)
    finally:
        loop.stop()
    assert not loop.is_alive(stall_s=60)


class RecordingHealth:
    def __init__(self) -> None:
        self.sets: list[tuple[str, int]] = []

    async def set(self, name: str, status: int) -> None:
        self.sets.append((name, status))


async def test_watch_engine_sets_health_when_liveness_changes() -> None:
    alive = [True]
    health = RecordingHealth()
    names = ("tandem.v1.DecodeWorker", "tandem.v1.KvTransfer")
    task = asyncio.create_task(
        watch_engine(lambda: alive[0], health, names, logging.getLogger("test"), period_s=0.01)
    )
    try:
        await asyncio.sleep(0.05)
        assert health.sets == []  # alive from the start: nothing to change
        alive[0] = False
        await asyncio.sleep(0.05)
        down = [(name, NOT_SERVING) for name in ("", *names)]
        assert health.sets == down  # once, not at every look
        alive[0] = True
        await asyncio.sleep(0.05)
        assert health.sets == [*down, *[(name, SERVING) for name in ("", *names)]]
    finally:
        task.cancel()


async def test_watch_readiness_sets_the_overall_status_alone() -> None:
    """A router's overall health follows readiness (set at the first look, then on each
    change); an error asking (Redis out of reach) counts as not ready."""
    answers: list[bool | Exception] = [False, False, True, True, RuntimeError("redis"), True]
    health = RecordingHealth()

    def is_ready() -> bool:
        answer = answers.pop(0) if len(answers) > 1 else answers[0]
        if isinstance(answer, Exception):
            raise answer
        return answer

    task = asyncio.create_task(
        watch_readiness(is_ready, health, logging.getLogger("test"), period_s=0.01)
    )
    try:
        while len(answers) > 1:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
    finally:
        task.cancel()
    assert health.sets == [("", NOT_SERVING), ("", SERVING), ("", NOT_SERVING), ("", SERVING)]


def test_workers_report_their_engine_and_the_router_its_server() -> None:
    import argparse

    from decode_worker import cli as decode_cli
    from prefill_worker import cli as prefill_cli
    from router import cli as router_cli

    router = router_cli.role()
    assert router.is_alive is None  # no engine: health follows its workers
    for ready in (True, False):  # the GenerationService's answer
        component = SimpleNamespace(service=SimpleNamespace(is_ready=lambda r=ready: r))
        assert router.is_ready is not None and router.is_ready(component) is ready
    for cli in (prefill_cli, decode_cli):
        role = cli.role()
        parser = argparse.ArgumentParser()
        cli.add_arguments(parser)
        args = parser.parse_args(["--model", "m", "--redis-url", "redis://127.0.0.1:1"])
        assert args.engine_stall_s == 300.0
        asked: list[float] = []

        def is_alive(stall_s: float, asked: list[float] = asked) -> bool:
            asked.append(stall_s)
            return True

        service = SimpleNamespace(engine_loop=SimpleNamespace(is_alive=is_alive))
        assert role.is_alive is not None and role.is_alive(service, args) is True
        assert asked == [300.0]

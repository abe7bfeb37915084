"""EngineLoop: what leaves the engine thread is never ahead of the figures Stats reads."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Any

from serving.engine_loop import EngineLoop


class SlowBlocks:
    """A block manager whose figures take a while to read, as on a loaded machine."""

    num_blocks = 8

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
        step=step,
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
        on_step=lambda engine, outputs: outputs[0],
        deliver=deliver,
        on_error=lambda error: None,
    )
    loop.start()
    try:

        def reserve() -> None:  # a call that takes blocks, then two steps that free them
            blocks.free = 3
            steps.extend([5, 8])

        await loop.call(reserve)
        assert loop.stats.num_free_blocks == 3
        while len(seen_on_delivery) < 2:
            await asyncio.sleep(0.01)
        assert seen_on_delivery == [(5, 5), (8, 8)]
    finally:
        loop.stop()

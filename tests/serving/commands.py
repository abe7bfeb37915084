"""A test's own calls on an engine thread, as engine commands (serving.engine_commands)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from engine.llm_engine import LLMEngine
from serving.engine_commands import EngineCommand


@dataclass(frozen=True)
class Do(EngineCommand[Any]):
    """``fn()`` on the engine thread, as new work (refused when the queue is full)."""

    fn: Callable[[], Any]

    def run(self, engine: LLMEngine) -> Any:
        return self.fn()


@dataclass(frozen=True)
class Cleanup(Do):
    """``fn()`` as cleanup: never refused."""

    is_new_work: ClassVar[bool] = False

"""An engine's warm-up: what it runs before it serves, so that no request waits for it."""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Protocol

from engine.dp_blocks import KvBlocks
from engine.outputs import RequestDelta
from engine.sampling_params import SamplingParams
from engine.spec.spec_runner import SpecRunner

logger = logging.getLogger(__name__)


class Warmable(Protocol):
    """What the warm-up uses of an ``LLMEngine``."""

    block_manager: KvBlocks
    spec: SpecRunner | None

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> None: ...

    def has_unfinished_requests(self) -> bool: ...

    def step_deltas(self) -> list[RequestDelta]: ...


def warm_up(engine: Warmable) -> None:
    """Runs every lazy initialization and compiles the decode graphs now, then forgets
    the warm-up's counters and cached prefixes: generations of 1 row and of 3 rows (one
    of them sampled), each with contexts of one block and of three. Dynamo specializes
    a dimension of size 1: one row, and a block table one block wide, are graphs of
    their own; a graph first traced at 2 keeps that size static, one traced at 3 serves
    every size from 2 on. So a served request never waits for a graph to compile
    (one takes about 40 s at one thread on SmolLM2)."""
    started = time.perf_counter()
    # Contexts within one block (a 1-token prompt and up to block_size - 1 new tokens),
    # and across three (the table's width may then grow: it stays symbolic).
    bs = engine.block_manager.block_size
    shapes = ((1, max(1, min(4, bs - 1))), (2 * bs + 8, 4))  # (prompt length, max_tokens)
    for num_rows in (1, 3):
        for length, max_tokens in shapes:
            for row in range(num_rows):
                params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
                if row == 2:
                    params = dataclasses.replace(params, temperature=1.0, seed=0)
                rid = f"warm-up-{num_rows}-{length}-{row}"
                engine.add_request(rid, [1 + row] * length, params)
            while engine.has_unfinished_requests():
                engine.step_deltas()
    engine.block_manager.reset_prefix_cache()
    if engine.spec is not None:
        engine.spec.warm_up(engine.block_manager.clean_block_ids)
        engine.spec.forget()
    logger.info("warmed up in %.1f s", time.perf_counter() - started)

"""Best-of timing for the kernels' ``python -m`` benchmarks."""

from __future__ import annotations

import time
from collections.abc import Callable


def best_ms(fn: Callable[[], object], repeat: int = 30, warmup: int = 3) -> float:
    """The best of 5 averages of ``repeat`` calls, in ms, after ``warmup`` calls: cache-hot,
    and the least disturbed by a shared machine."""
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(repeat):
            fn()
        best = min(best, (time.perf_counter() - start) / repeat)
    return best * 1e3

"""When requests start in an open-loop run: gaps drawn from a gamma distribution whose
mean is 1 / rate (as `vllm bench serve` draws them). Its shape is the burstiness: 1 is a
Poisson process (exponential gaps), below 1 burstier, above 1 more regular. Seeded: one
seed gives the same times."""

from __future__ import annotations

import math
import random
from collections.abc import Iterator


def gaps(rate: float, burstiness: float = 1.0, seed: int = 0) -> Iterator[float]:
    """Endless seconds between one request's start and the next's, at ``rate`` requests per
    second on average; all 0 for an infinite rate (everything at once)."""
    if not rate > 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    if not burstiness > 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if math.isinf(rate):
        while True:
            yield 0.0
    rng = random.Random(seed)
    scale = 1 / (rate * burstiness)  # mean = shape * scale = 1 / rate
    while True:
        yield rng.gammavariate(burstiness, scale)


def start_times(rate: float, burstiness: float = 1.0, seed: int = 0) -> Iterator[float]:
    """Endless start times from 0: the first request at 0, then the running sum of
    ``gaps``."""
    t = 0.0
    yield t
    for gap in gaps(rate, burstiness, seed):
        t += gap
        yield t

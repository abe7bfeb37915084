"""The cost of drawing the next token, per step, at SmolLM2's vocabulary (49,152) on this
machine: Tandem's seeded draw (inverse CDF at one keyed uniform per row), the exponential
race it replaced (argmax p_i / E_i with a keyed uniform per vocabulary entry), and what
transformers does (``torch.multinomial`` on the softmax, unseeded per row), side by side.

Each figure is the median of ``--repeats`` timings of one call on fp32 logits [B, V],
temperature 1.0, without and with top-p 0.95 (which sorts the vocabulary in all three).
For scale: one bf16 decode step of SmolLM2-135M at batch 64 took 170-220 ms here
(64 greedy steps of 64 rows, compiled and eager).

    python bench/sampling.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.sampler import SamplingTensors, filtered_probs, row_keys, sample, uniform
from engine.sampling_params import SamplingParams

VOCAB = 49_152


def race(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """The previous draw: exponential race over the whole vocabulary."""
    probs = filtered_probs(logits, t)
    exp = -torch.log(uniform(row_keys(t.seeds, t.positions), logits.shape[-1]))
    return (probs / exp).argmax(dim=-1)


def multinomial(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """transformers' sampling: one multinomial draw from the filtered softmax."""
    return torch.multinomial(filtered_probs(logits, t), 1).squeeze(-1)


def timed(
    fn: Callable[[torch.Tensor, SamplingTensors], torch.Tensor],
    logits: torch.Tensor,
    t: SamplingTensors,
    repeats: int,
) -> float:
    fn(logits, t)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(logits, t)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    results: dict[str, dict[str, float]] = {}
    print(f"{'setting':<18}{'Tandem draw':>14}{'race (before)':>15}{'multinomial':>13}  (ms)")
    for top_p in (1.0, 0.95):
        for b in args.batches:
            logits = torch.randn(b, VOCAB, generator=gen) * 3
            params = [SamplingParams(temperature=1.0, top_p=top_p)] * b
            t = SamplingTensors.build(params, list(range(b)), [100] * b, torch.device("cpu"))
            row = {
                "draw_ms": timed(sample, logits, t, args.repeats),
                "race_ms": timed(race, logits, t, args.repeats),
                "multinomial_ms": timed(multinomial, logits, t, args.repeats),
            }
            name = f"b{b}_top_p{top_p}"
            results[name] = row
            print(
                f"{name:<18}{row['draw_ms']:>14.1f}{row['race_ms']:>15.1f}"
                f"{row['multinomial_ms']:>13.1f}"
            )
    print(json.dumps({"vocab": VOCAB, "threads": torch.get_num_threads(), "results": results}))


if __name__ == "__main__":
    main()

"""Adaptive speculation: choose K per step from measured step costs and observed acceptance.

Verifying K+1 tokens per row is almost free at batch 1 on a bandwidth-bound device but
costs several plain steps at large batch, where the matrix products become compute-bound.
With ``cost[B][K]`` the measured time of a unified step at batch B and depth K, and
``alpha_j`` the observed probability that draft j is accepted once drafts 1..j-1 were,
the expected tokens per row-step are ``tau(K) = 1 + sum_{j<=K} prod_{i<=j} alpha_i``;
the controller picks the K that maximises ``tau(K) / cost[B][K]``, K = 0 (plain decoding)
included, so speculation never makes a batch slower than not speculating.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence


class AdaptiveK:
    def __init__(
        self,
        choices: Sequence[int],  # allowed K values, 0 included
        costs: dict[int, dict[int, float]],  # batch bucket -> K -> seconds per step
        *,
        prior_acceptance: float = 0.5,
        decay: float = 0.98,  # weight of the past in the acceptance estimates, per step
        probe_every: int = 64,  # steps at a reduced K between refreshes of the estimates
    ) -> None:
        self.choices = sorted(set(choices) | {0})
        self.max_k = self.choices[-1]
        self.costs = costs
        self.buckets = sorted(costs)
        self.decay, self.probe_every = decay, probe_every
        self._accepted = [prior_acceptance] * self.max_k  # decayed counts, per position
        self._verified = [1.0] * self.max_k
        self._since_probe = 0

    def alphas(self) -> list[float]:
        return [
            a / v if v > 0 else 0.0 for a, v in zip(self._accepted, self._verified, strict=True)
        ]

    def expected_tokens(self, k: int) -> float:
        tau, run = 1.0, 1.0
        for alpha in self.alphas()[:k]:
            run *= alpha
            tau += run
        return tau

    def choose(self, batch_size: int) -> int:
        bucket = self.buckets[
            min(bisect.bisect_left(self.buckets, batch_size), len(self.buckets) - 1)
        ]
        cost = self.costs[bucket]
        best = max(
            (k for k in self.choices if k in cost), key=lambda k: self.expected_tokens(k) / cost[k]
        )
        if best < self.max_k:
            self._since_probe += 1
            if self._since_probe >= self.probe_every:  # refresh what deeper drafts achieve
                self._since_probe = 0
                return self.max_k
        return best

    def observe(self, k: int, num_accepted: Sequence[int]) -> None:
        """Conditional acceptance per position from one step of ``k`` drafts per row."""
        if k == 0:
            return
        for j in range(k):
            reached = sum(1 for a in num_accepted if a >= j)
            passed = sum(1 for a in num_accepted if a > j)
            self._verified[j] = self.decay * self._verified[j] + reached
            self._accepted[j] = self.decay * self._accepted[j] + passed


def measure_costs(
    run_step: Callable[[int, int], float],  # (batch, k) -> seconds of one step
    buckets: Sequence[int],
    choices: Sequence[int],
    repeats: int = 2,
) -> dict[int, dict[int, float]]:
    """Best-of-``repeats`` step time for every bucket and K (after one warm-up run)."""
    costs: dict[int, dict[int, float]] = {}
    for b in buckets:
        costs[b] = {}
        for k in sorted(set(choices) | {0}):
            run_step(b, k)
            costs[b][k] = min(run_step(b, k) for _ in range(repeats))
    return costs

"""Adaptive speculation: choose K per step from measured step costs and observed acceptance.

Verifying K+1 tokens per row is almost free at batch 1 on a bandwidth-bound device but
costs several plain steps at large batch, where the matrix products become compute-bound.
With ``cost[B][K]`` the measured time of a unified step at batch B and depth K, and
``alpha_j`` the observed probability that draft j is accepted once drafts 1..j-1 were,
the expected tokens per row-step are ``tau(K) = 1 + sum_{j<=K} prod_{i<=j} alpha_i``;
the controller picks the K that maximises ``tau(K) / cost[B][K]``, K = 0 (plain decoding)
included, so speculation never makes a batch slower than not speculating.

The costs start from a measurement at start-up (short contexts, scratch blocks) and then
follow the steps actually run (``observe_cost``): verifying K+1 tokens per row costs more
against long contexts and large batches than the start-up steps showed. Measured on a
2-core CPU at batch 32 with the start-up costs alone, adaptive EAGLE-3 ran at 0.72x plain
decoding: the 32-token contexts made K=1 look almost free.

While K stays below the deepest choice, the estimates of the deeper drafts' acceptance
would go stale, so now and then a probe step drafts ``max_k`` tokens. Probes are paid
from a budget: every step below ``max_k`` earns ``probe_budget`` of its estimated cost,
and a probe spends what it costs beyond the chosen K (``charge`` adds costs outside the
step model, such as the drafter catching up after plain steps). At batch 1, where a
deep step costs little more, that is a probe every few dozen steps; at batch 32, where
it costs three plain steps and a catch-up, one every few hundred. With a probe every 64
steps regardless, adaptive EAGLE-3 ran at 0.78x plain decoding at batch 32 (SmolLM2,
2-core CPU, compiled); with the budget, at 1.06x.
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
        probe_budget: float = 0.02,  # share of the step time that probes may spend
        cost_weight: float = 0.2,  # weight of one observed step in its cost estimate
        max_cost_rise: float = 2.0,  # an observed cost counts as at most this x the estimate
    ) -> None:
        self.choices = sorted(set(choices) | {0})
        self.max_k = self.choices[-1]
        self.costs = {bucket: dict(by_k) for bucket, by_k in costs.items()}
        self.buckets = sorted(costs)
        self.decay, self.probe_budget, self.cost_weight = decay, probe_budget, cost_weight
        self.max_cost_rise = max_cost_rise
        self._accepted = [prior_acceptance] * self.max_k  # decayed counts, per position
        self._verified = [1.0] * self.max_k
        self._probe_credit = 0.0  # seconds

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

    def bucket(self, batch_size: int) -> int:
        return self.buckets[
            min(bisect.bisect_left(self.buckets, batch_size), len(self.buckets) - 1)
        ]

    def choose(self, batch_size: int) -> int:
        cost = self.costs[self.bucket(batch_size)]
        best = max(
            (k for k in self.choices if k in cost), key=lambda k: self.expected_tokens(k) / cost[k]
        )
        if best < self.max_k and self.max_k in cost:
            self._probe_credit += self.probe_budget * cost[best]
            extra = cost[self.max_k] - cost[best]
            if self._probe_credit >= extra:  # refresh what deeper drafts achieve
                self._probe_credit -= extra
                return self.max_k
        return best

    def charge(self, seconds: float) -> None:
        """Time spent for speculation outside the modelled steps: probes wait for it."""
        self._probe_credit -= seconds

    def observe_cost(self, batch_size: int, k: int, seconds: float) -> None:
        """One step of ``batch_size`` rows at depth ``k`` took ``seconds``: its bucket's
        cost at ``k`` moves towards it (scaled to the bucket's size, since rows cost about
        alike within a bucket)."""
        if batch_size <= 0:
            return
        bucket = self.bucket(batch_size)
        cost = self.costs[bucket]
        if k in cost:
            # At most twice the estimate: a step that compiled a graph (seconds, not
            # milliseconds) or lost the CPU says nothing of what steps cost, and a K
            # whose estimate it inflated would never be chosen, so never timed again.
            # A real rise (longer contexts) still lifts the estimate 20% a step.
            seen = min(seconds * bucket / batch_size, self.max_cost_rise * cost[k])
            cost[k] += self.cost_weight * (seen - cost[k])

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

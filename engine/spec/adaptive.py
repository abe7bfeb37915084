"""Adaptive speculation: choose K per step from measured step costs and observed acceptance.

Verifying K+1 tokens per row is almost free at batch 1 on a bandwidth-bound device but
costs several plain steps at large batch, where the matrix products become compute-bound.
With ``cost[B][K]`` the measured time of a unified step at batch B and depth K, and
``alpha_j`` the observed probability that draft j is accepted once drafts 1..j-1 were,
the expected tokens per row-step are ``tau(K) = 1 + sum_{j<=K} prod_{i<=j} alpha_i``;
the controller picks the K that maximises ``tau(K) / cost[B][K]``, K = 0 (plain decoding)
included, so speculation never makes a batch slower than not speculating.

A step's cost is a line in the rows' mean KV length (``StepCost``): the matrix products
do not grow with it, attention does, and it grows K+1 times faster for K+1 queries per
row. Start-up measures each line at a short and a long context on scratch blocks: costs
measured at a short context alone make shallow drafts look almost free at large batch.

The steps actually run scale a bucket's lines alike (``observe_cost``): what a step shows
is mostly how fast the machine runs just then, which holds for every K. So the choice of
K rests on the start-up lines, and the scale prices probes against time charged from
outside. A scale per K would let a slow spell make one K look dear for good, and a K
chosen steadily is the only one timed, so no step could show that another had become the
better choice.

Every step also pays the engine's own time outside the step: scheduling, the rows'
tokens, stop checks, the deltas (and, offline, the outputs assembled from them). It is
the same for every K, so it adds to each K's cost before the ratio is taken
(``observe_overhead``: the time between one decode step's end and the next one's start).
Left out, it makes deep drafts look dearer than they are end to end.

While K stays below the deepest choice, the estimates of the deeper drafts' acceptance
would go stale, so now and then a probe step drafts ``max_k`` tokens. Probes are paid
from a budget: every step below ``max_k`` earns ``probe_budget`` of its estimated cost,
and a probe spends what it costs beyond the chosen K (``charge`` adds costs outside the
step model, such as the drafter catching up after plain steps). Where a deep step costs
little more (batch 1), that is a probe every few dozen steps; where it costs several
plain steps and a catch-up (batch 32), one every few hundred. Probes at a fixed interval
would cost a large batch more than speculation gains it.

Start-up measures at contexts up to 512 tokens; a bucket whose steps run at contexts
``refresh_factor`` times longer than it was measured at is stale (``stale``), and
``CostRefresh`` measures it again at such a context while the engine is idle, one K at a
time, within a budget of time.

The measurements behind these choices are in ``bench/RESULTS.md`` ("Adaptive K and draft
training: measurements moved out of docstrings").
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class StepCost:
    """Seconds of one step against the rows' mean KV length: ``base + per_token * context``,
    flat below ``min_context`` (the shortest context measured)."""

    base: float
    per_token: float = 0.0
    min_context: float = 0.0

    def at(self, context: float) -> float:
        return self.base + self.per_token * max(context, self.min_context)

    @classmethod
    def fit(cls, short: tuple[float, float], long: tuple[float, float]) -> StepCost:
        """The line through two (context, seconds) measurements, never falling with context
        and not extended below the short one: where a slow spell of the machine inflated the
        long measurement, the line crosses zero at a short context, and a step there would
        cost nothing or less (the engine's time per step, and every K's cost with it, would
        go negative)."""
        (c0, t0), (c1, t1) = short, long
        per_token = max(0.0, (t1 - t0) / (c1 - c0)) if c1 != c0 else 0.0
        return cls(t0 - per_token * c0, per_token, min(c0, c1))


class AdaptiveK:
    def __init__(
        self,
        choices: Sequence[int],  # allowed K values, 0 included
        costs: dict[int, dict[int, StepCost]],  # batch bucket -> K -> seconds per step
        *,
        prior_acceptance: float = 0.5,
        decay: float = 0.98,  # weight of the past in the acceptance estimates, per step
        probe_budget: float = 0.02,  # share of the step time that probes may spend
        cost_weight: float = 0.2,  # weight of one observed step in its cost estimate
        max_cost_rise: float = 2.0,  # an observed cost counts as at most this x the estimate
        measured_context: float = float("inf"),  # the longest context the costs were timed at
        refresh_factor: float = 1.5,  # steps this much longer than measured make a bucket stale
    ) -> None:
        self.choices = sorted(set(choices) | {0})
        self.max_k = self.choices[-1]
        self.costs = {bucket: dict(by_k) for bucket, by_k in costs.items()}
        self.scales = dict.fromkeys(costs, 1.0)  # steps run against the start-up lines
        self.buckets = sorted(costs)
        self.decay, self.probe_budget, self.cost_weight = decay, probe_budget, cost_weight
        self.max_cost_rise = max_cost_rise
        self._accepted = [prior_acceptance] * self.max_k  # decayed counts, per position
        self._verified = [1.0] * self.max_k
        self._probe_credit = 0.0  # seconds
        self.overhead = 0.0  # seconds of engine time per step outside the step, every K alike
        self.measured = dict.fromkeys(costs, measured_context)  # bucket -> longest timed context
        self.refresh_factor = refresh_factor
        self.stale: dict[int, float] = {}  # bucket -> the longest context its steps ran at

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

    def cost(self, batch_size: int, k: int, context: float = 0.0) -> float:
        """Estimated seconds of a step of ``batch_size``'s bucket at depth ``k``."""
        bucket = self.bucket(batch_size)
        return self.scales[bucket] * self.costs[bucket][k].at(context)

    def cost_at(self, batch_size: int, depth: float, context: float = 0.0) -> float:
        """``cost`` at a fractional depth, between the two Ks around it: what a packed step
        of ``batch_size * (1 + depth)`` tokens costs (a uniform step of that many does)."""
        bucket = self.bucket(batch_size)
        known = sorted(self.costs[bucket])
        lo = max((k for k in known if k <= depth), default=known[0])
        hi = min((k for k in known if k >= depth), default=known[-1])
        if hi == lo:
            return self.cost(bucket, lo, context)
        share = (depth - lo) / (hi - lo)
        low, high = self.cost(bucket, lo, context), self.cost(bucket, hi, context)
        return low + share * (high - low)

    def choose(self, batch_size: int, context: float = 0.0) -> int:
        """K for a step of ``batch_size`` rows whose mean KV length is ``context``."""
        bucket = self.note_context(batch_size, context)
        deepest = self.max_k
        cost = {k: self.cost(bucket, k, context) for k in self.choices if k in self.costs[bucket]}
        best = max(cost, key=lambda k: self.expected_tokens(k) / (cost[k] + self.overhead))
        if best < deepest and deepest in cost:
            self._probe_credit += self.probe_budget * cost[best]
            extra = cost[deepest] - cost[best]
            if self._probe_credit >= extra:  # refresh what deeper drafts achieve
                self._probe_credit -= extra
                return deepest
        return best

    def note_context(self, batch_size: int, context: float) -> int:
        """A step of ``batch_size`` rows runs at mean KV length ``context``: its bucket
        (returned) is stale if that is much longer than its costs were measured at."""
        bucket = self.bucket(batch_size)
        if context > self.refresh_factor * self.measured[bucket]:
            self.stale[bucket] = max(context, self.stale.get(bucket, 0.0))
        return bucket

    def remeasured(self, bucket: int, context: float, seconds: dict[int, float]) -> None:
        """Steps of ``bucket`` rows at KV length ``context`` took ``seconds`` per K, timed now:
        each K's line runs from its short end through them (in the start-up lines' units:
        the bucket's scale says how much faster or slower the machine runs now)."""
        for k, taken in seconds.items():
            line = self.costs[bucket][k]
            short = (line.min_context, line.at(line.min_context))
            self.costs[bucket][k] = StepCost.fit(short, (context, taken / self.scales[bucket]))
        self.measured[bucket] = max(self.measured[bucket], context)
        if self.stale.get(bucket, 0.0) <= self.refresh_factor * self.measured[bucket]:
            self.stale.pop(bucket, None)  # else steps ran longer still while it was timed

    def charge(self, seconds: float) -> None:
        """Time spent for speculation outside the modelled steps: probes wait for it."""
        self._probe_credit -= seconds

    def observe_cost(self, batch_size: int, k: float, seconds: float, context: float = 0.0) -> None:
        """One step of ``batch_size`` rows at depth ``k`` (a packed step's: its rows' mean)
        and mean KV length ``context`` took ``seconds``: its bucket's scale moves towards
        what that shows (scaled to the bucket's size, since rows cost about alike within a
        bucket)."""
        if batch_size <= 0:
            return
        bucket = self.bucket(batch_size)
        if not 0 <= k <= max(self.costs[bucket]):
            return
        estimate = self.cost_at(bucket, k, context)
        # At most twice the estimate: a step that compiled a graph (seconds, not
        # milliseconds) or lost the CPU says little of what steps cost. A real rise still
        # lifts the estimate 20% a step.
        seen = min(seconds * bucket / batch_size, self.max_cost_rise * estimate)
        self.scales[bucket] *= 1 + self.cost_weight * (seen / estimate - 1)

    def observe_overhead(self, batch_size: int, seconds: float, context: float = 0.0) -> None:
        """The engine spent ``seconds`` outside the step between two decode steps; an
        observation counts as at most a plain step's estimated cost (a pause of the whole
        process says nothing of what every step pays)."""
        seen = min(seconds, self.cost(batch_size, 0, context))
        self.overhead += self.cost_weight * (seen - self.overhead)

    def observe(self, k: int, num_accepted: Sequence[int]) -> None:
        """Conditional acceptance per position from one step of ``k`` drafts per row."""
        self.observe_rows([k] * len(num_accepted), num_accepted)

    def observe_rows(self, lengths: Sequence[int], num_accepted: Sequence[int]) -> None:
        """The same from one step whose rows verified ``lengths`` drafts each."""
        for j in range(min(self.max_k, max(lengths, default=0))):
            rows = [a for a, n in zip(num_accepted, lengths, strict=True) if n > j]
            reached = sum(1 for a in rows if a >= j)
            passed = sum(1 for a in rows if a > j)
            self._verified[j] = self.decay * self._verified[j] + reached
            self._accepted[j] = self.decay * self._accepted[j] + passed


def measure_costs(
    run_step: Callable[[int, int, int], float],  # (batch, k, context) -> seconds of one step
    buckets: Sequence[int],
    choices: Sequence[int],
    contexts: tuple[int, int],  # a short and a long KV length
    repeats: int = 3,
) -> dict[int, dict[int, StepCost]]:
    """Per bucket and K, the line through the fastest of ``repeats`` step times at both
    contexts. The Ks take turns, after one warm-up step each: a slow spell of the machine
    slows every K's step alike, where timing one K after another could make a single K
    look dear and change the choice for good."""
    ks = sorted(set(choices) | {0})
    costs: dict[int, dict[int, StepCost]] = {}
    for b in buckets:
        points: dict[int, list[tuple[int, float]]] = {k: [] for k in ks}
        for context in contexts:
            times: dict[int, list[float]] = {k: [] for k in ks}
            for k in ks:
                run_step(b, k, context)
            for _ in range(repeats):
                for k in ks:
                    times[k].append(run_step(b, k, context))
            for k in ks:
                points[k].append((context, min(times[k])))
        costs[b] = {k: StepCost.fit(points[k][0], points[k][1]) for k in ks}
    return costs


class CostRefresh:
    """Times stale buckets again (``AdaptiveK.stale``) while the engine is idle: one K's
    steps per call of ``run_one``, so that a request arriving meanwhile waits at most
    about ``max_pause_s``, and the bucket's lines change together once every K is timed.
    All of it within ``share`` of the time since start, plus ``allowance_s``. A bucket whose
    steps would pause longer than ``max_pause_s`` is not timed: the scale its steps keep
    (``observe_cost``) is all it gets."""

    def __init__(
        self,
        adaptive: AdaptiveK,
        max_context: int,  # the longest KV length a scratch step may reach
        *,
        share: float = 0.02,
        allowance_s: float = 2.0,
        max_pause_s: float = 0.25,
        repeats: int = 3,  # steps per K, the first a warm-up
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.adaptive, self.max_context = adaptive, max_context
        self.share, self.allowance_s, self.max_pause_s = share, allowance_s, max_pause_s
        self.repeats, self.clock = repeats, clock
        self.started = clock()
        self.spent = 0.0  # seconds of steps run
        self.num_refreshed = 0  # buckets timed again
        self._pending: tuple[int, int, list[int], dict[int, float]] | None = None

    def is_wanted(self) -> bool:
        """A bucket to time, and budget left for it."""
        if self._pending is None and not self.adaptive.stale:
            return False
        return self.spent < self.share * (self.clock() - self.started) + self.allowance_s

    def run_one(self, run_step: Callable[[int, int, int], float]) -> float:
        """Times one K of the bucket being refreshed (choosing one first) with ``run_step``
        ((batch, k, context) -> seconds of one step); seconds taken."""
        adaptive = self.adaptive
        if self._pending is None:
            if not adaptive.stale:
                return 0.0
            bucket, seen = next(iter(adaptive.stale.items()))
            # Longer than seen, as contexts grow: the line is then interpolated.
            context = int(min(self.max_context, adaptive.refresh_factor * seen))
            pause = self.repeats * max(adaptive.cost(bucket, k, context) for k in adaptive.choices)
            if context <= adaptive.measured[bucket] or pause > self.max_pause_s:
                adaptive.stale.pop(bucket)
                adaptive.measured[bucket] = max(adaptive.measured[bucket], context)
                return 0.0
            self._pending = (bucket, context, list(adaptive.choices), {})
        bucket, context, ks, timed = self._pending
        k = ks.pop(0)
        started = self.clock()
        times = [run_step(bucket, k, context) for _ in range(self.repeats)]
        timed[k] = min(times[1:] or times)
        if not ks:
            adaptive.remeasured(bucket, context, timed)
            self.num_refreshed += 1
            self._pending = None
        taken = self.clock() - started
        self.spent += taken
        return taken

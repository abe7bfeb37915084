"""Which of the rows' proposed tokens a packed step verifies: suffix decoding's per-row caps.

Suffix decoding proposes per row as many tokens as its match supports, and how likely
they are to be accepted differs by row far more than by position: after a match of the
index's 2-token key alone, about half of the first tokens are accepted; after a match of
16 tokens or more, nineteen in twenty of every token (bench/RESULTS.md). One cap for the
whole batch, as ``AdaptiveK.choose`` picks, either verifies the short matches' weak tokens
or cuts the long ones short.

So each proposed token gets an estimate of the chance that it is accepted, and the step
verifies the tokens that pay for themselves:

- **Acceptance.** Token j of a proposal is accepted, once tokens 0..j-1 were, at a rate
  learned per bin (``AcceptanceBins``): the match's length (2, 3-5, 6-15, 16 and more
  tokens), the position (0..3, and 4 on), and whether every occurrence agreed on the token
  (``Proposal.probs`` == 1). Decayed counts, with a prior of ``m / (m + 1)`` for a match of
  ``m`` tokens (halved where the occurrences disagreed), worth two observations.
- **Selection.** A token's value is the chance that it is emitted: the product of the
  rates of itself and the tokens before it, which never grows along a proposal. Taking
  tokens in falling value (each row's in order), the step of ``B`` rows and ``n`` drafts
  yields ``B`` plus their values in tokens, and costs ``AdaptiveK.cost_at(B, n / B)`` plus
  the engine's time between steps: ``select`` keeps the prefix with the most tokens per
  second, none (a plain step) included.
- **Probes.** A bin whose rate looks too low to verify is never verified again, and would
  never be seen to improve. Every step earns ``AdaptiveK.probe_budget`` of its cost; when
  the credit covers what verifying every proposed token costs beyond the selection, the
  step does so.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from engine.spec.adaptive import AdaptiveK
from engine.spec.suffix import Proposal

MATCH_BUCKETS = (2, 3, 6, 16)  # a bin's match length: at least this many tokens
MAX_POSITION = 4  # positions from here on share a bin


class AcceptanceBins:
    """Per bin (match length, position, agreement), the decayed share of reached proposed
    tokens that were accepted."""

    def __init__(self, *, prior_weight: float = 2.0, decay: float = 0.99) -> None:
        self.prior_weight, self.decay = prior_weight, decay
        self._accepted: dict[tuple[int, int, bool], float] = {}
        self._reached: dict[tuple[int, int, bool], float] = {}

    @staticmethod
    def bin(match_len: int, position: int, share: float) -> tuple[int, int, bool]:
        bucket = MATCH_BUCKETS[max(0, bisect.bisect_right(MATCH_BUCKETS, match_len) - 1)]
        return bucket, min(position, MAX_POSITION), share >= 1.0

    def rate(self, key: tuple[int, int, bool]) -> float:
        bucket, _, agreed = key
        prior = bucket / (bucket + 1) * (1.0 if agreed else 0.5)
        weight = self.prior_weight
        return (self._accepted.get(key, 0.0) + weight * prior) / (
            self._reached.get(key, 0.0) + weight
        )

    def values(self, proposal: Proposal) -> list[float]:
        """Per proposed token, the chance that it is emitted (all before it accepted)."""
        out, run = [], 1.0
        for j, share in enumerate(proposal.probs):
            run *= self.rate(self.bin(proposal.match_len, j, share))
            out.append(run)
        return out

    def observe(self, proposal: Proposal, verified: int, accepted: int) -> None:
        """``verified`` of ``proposal``'s tokens were verified, the first ``accepted`` of
        them accepted."""
        for j, share in enumerate(proposal.probs[: min(verified, accepted + 1)]):
            key = self.bin(proposal.match_len, j, share)
            self._reached[key] = self.decay * self._reached.get(key, 0.0) + 1.0
            self._accepted[key] = self.decay * self._accepted.get(key, 0.0) + (accepted > j)


class DraftSelector:
    """Per-row numbers of drafts to verify (see the module's docstring)."""

    def __init__(self, bins: AcceptanceBins | None = None) -> None:
        self.bins = bins or AcceptanceBins()
        self._probe_credit = 0.0  # seconds
        self.num_probes = 0

    def select(
        self, costs: AdaptiveK, batch_size: int, context: float, proposals: Sequence[Proposal]
    ) -> list[int]:
        """How many of each row's proposed tokens to verify, for a step of ``batch_size``
        rows (``proposals``, one per row) at mean KV length ``context``, priced by
        ``costs``' measured steps and the engine's overhead per step (and probing within
        its ``probe_budget``)."""
        costs.note_context(batch_size, context)

        def cost(num_drafts: int) -> float:
            return costs.cost_at(batch_size, num_drafts / batch_size, context) + costs.overhead

        deepest = costs.max_k
        offered = [min(len(p.tokens), deepest) for p in proposals]
        candidates = sorted(
            (
                (-value, j, row)
                for row, p in enumerate(proposals)
                for j, value in enumerate(self.bins.values(p)[: offered[row]])
            ),
        )
        tokens, best_ratio = float(batch_size), batch_size / cost(0)
        best = 0
        for n, (negative_value, _, _) in enumerate(candidates, start=1):
            tokens -= negative_value
            ratio = tokens / cost(n)
            if ratio > best_ratio:
                best, best_ratio = n, ratio
        lengths = [0] * len(proposals)
        for _, j, row in candidates[:best]:
            lengths[row] = max(lengths[row], j + 1)
        total = sum(offered)
        if best < total:
            self._probe_credit += costs.probe_budget * cost(best)
            extra = cost(total) - cost(best)
            if self._probe_credit >= extra:  # see how every bin does now
                self._probe_credit -= extra
                self.num_probes += 1
                return offered
        return lengths

    def observe(
        self, proposals: Sequence[Proposal], lengths: Sequence[int], num_accepted: Sequence[int]
    ) -> None:
        for proposal, n, a in zip(proposals, lengths, num_accepted, strict=True):
            self.bins.observe(proposal, n, a)

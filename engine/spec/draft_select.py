"""Which of the rows' proposed tokens a packed step verifies: suffix decoding's per-row caps.

How likely a suffix proposal's tokens are to be accepted depends on the row far more
than on the position: on how long a match proposed them (bench/RESULTS.md, "acceptance by
match length"). One cap for the whole batch would either verify short matches' weak
tokens or cut long ones short. So each proposed token gets the chance that
it is emitted, the product of learned acceptance rates (``AcceptanceBins``) of itself and
the tokens before it; taking tokens in falling chance (each row's in order), a step of B
rows and n drafts yields B plus their chances in tokens and costs ``AdaptiveK.cost_at(B,
n / B)`` plus the engine's time per step, and ``DraftSelector.select`` keeps the number of
tokens with the most tokens per second (none included). A bin whose rate looks too low
to verify would never be seen to improve: probes verify everything now and then, paid
from ``AdaptiveK.probe_budget`` as K's probes are.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import NamedTuple

from engine.spec.adaptive import AdaptiveK
from engine.spec.suffix import Proposal

MATCH_BUCKETS = (2, 3, 6, 16)  # a bin's match length: at least this many tokens
MAX_POSITION = 4  # positions from here on share a bin


class Bin(NamedTuple):
    match: int  # the match's length, down to a bucket of MATCH_BUCKETS
    position: int  # the token's place in the proposal, up to MAX_POSITION
    agreed: bool  # every occurrence still matching continued with this token


class AcceptanceBins:
    """Per bin, the decayed share of reached proposed tokens that were accepted, starting
    from a prior worth ``prior_weight`` observations: ``m / (m + 1)`` for the bucket's
    shortest match m, halved where the occurrences disagreed."""

    def __init__(self, *, prior_weight: float = 2.0, decay: float = 0.99) -> None:
        self.prior_weight, self.decay = prior_weight, decay
        self._accepted: dict[Bin, float] = {}
        self._reached: dict[Bin, float] = {}

    @staticmethod
    def bin(match_len: int, position: int, share: float) -> Bin:
        """The bin of a proposal's token ``position`` whose occurrences agreed ``share``."""
        bucket = MATCH_BUCKETS[max(0, bisect.bisect_right(MATCH_BUCKETS, match_len) - 1)]
        return Bin(bucket, min(position, MAX_POSITION), share >= 1.0)

    def rate(self, key: Bin) -> float:
        """The chance that a token of this bin is accepted once the ones before it were."""
        prior = key.match / (key.match + 1) * (1.0 if key.agreed else 0.5)
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
    """Per-row numbers of drafts to verify (see the module's docstring), and the probes'
    credit: a step that verifies less than was proposed earns its share."""

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
        """A step verified ``lengths`` of the rows' proposals and accepted ``num_accepted``."""
        for proposal, n, a in zip(proposals, lengths, num_accepted, strict=True):
            self.bins.observe(proposal, n, a)

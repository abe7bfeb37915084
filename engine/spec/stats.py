"""Counters of speculative decoding, and the mean accepted length derived from them."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    num_drafts: int = 0  # row-steps that verified at least one draft token
    num_draft_tokens: int = 0  # draft tokens verified
    num_accepted_tokens: int = 0  # of those, accepted
    num_steps_without_drafts: int = 0  # row-steps run with K = 0
    num_caught_up_positions: int = 0  # draft KV written late, for steps that left it idle
    accepted_per_position: list[int] = field(default_factory=list)  # [j]: drafts accepted at j
    verified_per_position: list[int] = field(default_factory=list)  # [j]: drafts verified at j
    steps_per_k: list[int] = field(default_factory=list)  # [k]: decode steps that verified k

    def record(self, k: int, num_accepted: list[int]) -> None:
        """One step of ``len(num_accepted)`` rows that verified ``k`` drafts each."""
        self.record_rows(k, [k] * len(num_accepted), num_accepted)

    def record_rows(self, k: int, lengths: list[int], num_accepted: list[int]) -> None:
        """One step of depth ``k`` whose rows verified ``lengths`` drafts each (<= k)."""
        if k >= len(self.steps_per_k):
            self.steps_per_k += [0] * (k + 1 - len(self.steps_per_k))
        self.steps_per_k[k] += 1
        grow = k - len(self.accepted_per_position)
        if grow > 0:
            self.accepted_per_position += [0] * grow
            self.verified_per_position += [0] * grow
        for n, a in zip(lengths, num_accepted, strict=True):
            if n == 0:
                self.num_steps_without_drafts += 1
                continue
            self.num_drafts += 1
            self.num_draft_tokens += n
            self.num_accepted_tokens += a
            for j in range(n):
                self.verified_per_position[j] += 1
                self.accepted_per_position[j] += j < a

    @property
    def mean_accepted_length(self) -> float:
        """tau: tokens emitted per verifying step and row (accepted drafts + 1)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def as_dict(self) -> dict[str, object]:
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "accepted_per_position": list(self.accepted_per_position),
            "steps_per_k": list(self.steps_per_k),
            "mean_accepted_length": self.mean_accepted_length,
        }

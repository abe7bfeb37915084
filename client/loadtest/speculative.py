"""Accepted tokens per step: speculative decoding's counters for a run, summed from each
request's usage (gRPC) or read from decode workers' Prometheus /metrics before and after the
run (``--metrics-url``; any target, counting every client's requests meanwhile)."""

from __future__ import annotations

import re
import urllib.request
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

# The decode worker's counters (serving.metrics), summed over their label sets.
COUNTERS = {
    "tandem_spec_drafts_total": "num_drafts",
    "tandem_spec_draft_tokens_total": "num_draft_tokens",
    "tandem_spec_accepted_tokens_total": "num_accepted_tokens",
}
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


@dataclass(frozen=True)
class SpecCounts:
    """What speculative decoding did over some requests (the SDK's ``SpeculativeUsage``)."""

    num_drafts: int = 0  # decode steps that verified at least one draft token
    num_draft_tokens: int = 0  # draft tokens verified
    num_accepted_tokens: int = 0  # of those, accepted

    def __add__(self, other: SpecCounts) -> SpecCounts:
        return SpecCounts(
            self.num_drafts + other.num_drafts,
            self.num_draft_tokens + other.num_draft_tokens,
            self.num_accepted_tokens + other.num_accepted_tokens,
        )

    def __sub__(self, other: SpecCounts) -> SpecCounts:
        return SpecCounts(
            self.num_drafts - other.num_drafts,
            self.num_draft_tokens - other.num_draft_tokens,
            self.num_accepted_tokens - other.num_accepted_tokens,
        )

    def figures(self, source: str) -> dict[str, object]:
        """The counts and their ratios (None without drafts): ``accepted_per_step`` draft
        tokens accepted per verifying step, ``tokens_per_step`` the tokens such a step
        emits (accepted + the verifier's own one), ``acceptance_rate`` accepted / drafted."""
        return {
            "source": source,
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "accepted_per_step": _ratio(self.num_accepted_tokens, self.num_drafts),
            "tokens_per_step": (
                1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None
            ),
            "acceptance_rate": _ratio(self.num_accepted_tokens, self.num_draft_tokens),
        }


def _ratio(numerator: int, denominator: int) -> float | None:
    return numerator / denominator if denominator else None


def total(counts: Iterable[SpecCounts | None]) -> SpecCounts | None:
    """The sum of the requests' counts; None when none carried any (no draft, or HTTP)."""
    present = [c for c in counts if c is not None]
    return sum(present, SpecCounts()) if present else None


def parse_counters(text: str) -> SpecCounts:
    """The speculative counters of a Prometheus text exposition, each summed over its label
    sets (0 for one that is absent: a worker without a draft). ValueError for a value that
    is not a number."""
    found = dict.fromkeys(COUNTERS.values(), 0)
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match and match.group(1) in COUNTERS:
            found[COUNTERS[match.group(1)]] += int(float(match.group(3)))
    return SpecCounts(**found)


def scrape(urls: Sequence[str], timeout_s: float = 10.0) -> SpecCounts:
    """The counters summed over the workers at ``urls``. OSError (a URLError) naming the
    URL that did not answer, ValueError for one whose answer is not Prometheus text."""
    counts = SpecCounts()
    for url in urls:
        try:
            with urllib.request.urlopen(url, timeout=timeout_s) as response:
                text = response.read().decode("utf-8")
        except OSError as e:
            raise OSError(f"{url} did not answer ({getattr(e, 'reason', e)})") from None
        except UnicodeDecodeError:
            raise ValueError(f"{url} did not answer Prometheus text") from None
        try:
            counts = counts + parse_counters(text)
        except ValueError as e:
            raise ValueError(f"{url}: {e}") from None
    return counts

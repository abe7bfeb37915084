"""Suffix decoding: drafts without a model, read from text the request or a recent one holds.

A row's tokens end with a context; where that context occurred before, what followed it
then is a likely continuation now. Code edits copy most of the code they are given, RAG
answers quote their sources, agent loops and JSON repeat themselves: there, the tokens
after an earlier occurrence are accepted far more often than a small draft model's.

Two structures are searched, as Arctic Inference's suffix decoding does (its paper, not
its code, was read):
- the request's own tokens, prompt and output (``RequestIndex``: one per request, on its
  ``Sequence``, gone with it), indexed as they grow;
- a shared one built from recent requests' outputs (``SharedIndex``), its size capped in
  tokens, the least recently used output dropped first.

Both index every ``key_len``-gram by where it ends. A proposal looks up the row's last
``key_len`` tokens, extends each earlier occurrence backwards to the longest common
suffix (up to ``max_match``), keeps the occurrences with the longest one, and walks
forward: at each step the token most of them continue with, its share of them as its
probability, the occurrences that disagree dropped. It stops at ``k`` tokens, at
``spec_factor`` times the match length (a short match supports a short proposal), or
where the product of the shares falls below ``min_token_prob``. The structure whose
match is longer proposes (the request's own on a tie).

Proposals are verified like any draft: greedy rows exactly, sampled rows by the lossless
rule with the proposal as a point mass (``engine.spec.acceptance``).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

Key = tuple[int, ...]
Occurrence = tuple[Sequence[int], int]  # (tokens, where the continuation starts)


@dataclass(frozen=True)
class SuffixConfig:
    key_len: int = 2  # tokens a match needs at least (the index's key)
    max_match: int = 32  # longest common suffix looked for
    spec_factor: float = 1.0  # tokens proposed per matched token, at most
    min_token_prob: float = 0.1  # stop where the proposal's estimated probability drops below
    max_occurrences: int = 32  # per key, the most recent kept
    shared_tokens: int = 1 << 18  # the shared index's cap, in tokens of output
    request_tokens: int = 1 << 13  # a request's own index covers its last this many tokens

    def __post_init__(self) -> None:
        if not 1 <= self.key_len <= self.max_match:
            raise ValueError(
                f"key_len: must be in 1..max_match ({self.max_match}), got {self.key_len}"
            )
        if self.spec_factor <= 0 or not 0 <= self.min_token_prob <= 1:
            raise ValueError(
                f"spec_factor, min_token_prob: need > 0 and in [0, 1], got "
                f"{self.spec_factor} and {self.min_token_prob}"
            )
        if self.max_occurrences < 1 or self.shared_tokens < 0 or self.request_tokens < 1:
            raise ValueError(
                f"max_occurrences, shared_tokens, request_tokens: need >= 1, >= 0 and >= 1, "
                f"got {self.max_occurrences}, {self.shared_tokens} and {self.request_tokens}"
            )


@dataclass(frozen=True)
class Proposal:
    tokens: list[int]
    probs: list[float]  # per token, its share of the occurrences still agreeing
    match_len: int  # tokens of context matched (0: none)
    source: object = None  # the shared document it came from, if any

    @classmethod
    def empty(cls) -> Proposal:
        return cls([], [], 0)


def longest_matches(
    context: Sequence[int], occurrences: list[Occurrence], key_len: int, max_match: int
) -> tuple[int, list[Occurrence]]:
    """The longest common suffix of ``context`` and the text before each occurrence (all
    of which share the last ``key_len`` tokens), and the occurrences that reach it; most
    recent first."""
    n = len(context)
    best, chosen = 0, []
    for tokens, start in reversed(occurrences):
        if start >= len(tokens):  # the context itself: nothing follows it yet
            continue
        m, limit = key_len, min(max_match, start, n)
        while m < limit and tokens[start - m - 1] == context[n - m - 1]:
            m += 1
        if m > best:
            best, chosen = m, [(tokens, start)]
        elif m == best:
            chosen.append((tokens, start))
    return best, chosen


def walk(
    occurrences: list[Occurrence], match_len: int, k: int, config: SuffixConfig
) -> tuple[list[int], list[float], Occurrence | None]:
    """Up to ``k`` tokens that most of ``occurrences`` continue with (see the module's
    docstring), their shares, and one occurrence that agrees with all of them."""
    limit = min(k, int(config.spec_factor * match_len))
    out: list[int] = []
    probs: list[float] = []
    alive, joint = occurrences, 1.0
    for i in range(limit):
        counts = Counter(t[s + i] for t, s in alive if s + i < len(t))
        if not counts:
            break
        token, count = counts.most_common(1)[0]  # ties: the most recent occurrence's
        share = count / sum(counts.values())
        joint *= share
        if joint < config.min_token_prob:
            break
        out.append(token)
        probs.append(share)
        alive = [(t, s) for t, s in alive if s + i < len(t) and t[s + i] == token]
    return out, probs, (alive[0] if alive else None)


class _Index:
    """``key_len``-grams of token documents, by where they end."""

    def __init__(self, config: SuffixConfig) -> None:
        self.config = config
        self.entries: dict[Key, list[Occurrence]] = {}

    def _add(self, tokens: Sequence[int], start: int) -> None:
        """Indexes the key ending just before ``start``."""
        key = tuple(tokens[start - self.config.key_len : start])
        found = self.entries.get(key)
        if found is None:
            self.entries[key] = [(tokens, start)]
            return
        found.append((tokens, start))
        if len(found) > self.config.max_occurrences:
            del found[0]

    def propose(self, context: Sequence[int], k: int) -> Proposal:
        config = self.config
        if k <= 0 or len(context) < config.key_len:
            return Proposal.empty()
        found = self.entries.get(tuple(context[-config.key_len :]))
        if not found:
            return Proposal.empty()
        match_len, chosen = longest_matches(context, found, config.key_len, config.max_match)
        if not chosen:
            return Proposal.empty()
        tokens, probs, agreeing = walk(chosen, match_len, k, config)
        return Proposal(tokens, probs, match_len, None if agreeing is None else agreeing[0])


class RequestIndex(_Index):
    """One request's tokens (the live list, read as it grows), indexed up to the token
    before its last: the last key is the context itself, with nothing after it yet. A long
    prompt is indexed from its last ``config.request_tokens`` tokens on: the index's memory
    (a few hundred bytes a token) and the first step's work stay bounded."""

    def __init__(self, tokens: list[int], config: SuffixConfig) -> None:
        super().__init__(config)
        self.tokens = tokens
        # continuations from key_len on, within the last request_tokens of the prompt
        self.num_indexed = max(config.key_len, len(tokens) - config.request_tokens) - 1

    def sync(self) -> None:
        for start in range(self.num_indexed + 1, len(self.tokens)):
            self._add(self.tokens, start)
        self.num_indexed = max(self.num_indexed, len(self.tokens) - 1)

    def propose(self, context: Sequence[int], k: int) -> Proposal:
        self.sync()
        return super().propose(context, k)


class SharedIndex(_Index):
    """Recent requests' outputs, at most ``config.shared_tokens`` tokens of them: adding
    one drops the least recently used (added, or proposed from) until it fits."""

    def __init__(self, config: SuffixConfig) -> None:
        super().__init__(config)
        self.docs: OrderedDict[int, tuple[int, ...]] = OrderedDict()  # id(doc) -> doc
        self.num_tokens = 0

    def add(self, output: Sequence[int]) -> None:
        cap = self.config.shared_tokens
        doc = tuple(output[-cap:]) if cap else ()
        if len(doc) <= self.config.key_len:
            return
        self.docs[id(doc)] = doc
        self.num_tokens += len(doc)
        for start in range(self.config.key_len, len(doc)):
            self._add(doc, start)
        while self.num_tokens > cap:
            self._drop(next(iter(self.docs)))

    def _drop(self, doc_id: int) -> None:
        doc = self.docs.pop(doc_id)
        self.num_tokens -= len(doc)
        key_len = self.config.key_len
        for start in range(key_len, len(doc)):
            key = tuple(doc[start - key_len : start])
            found = self.entries.get(key)
            if found is None:
                continue
            kept = [o for o in found if o[0] is not doc]
            if kept:
                self.entries[key] = kept
            else:
                del self.entries[key]

    def touch(self, doc: object) -> None:
        """``doc`` was proposed from: the last to be dropped."""
        if id(doc) in self.docs and self.docs[id(doc)] is doc:
            self.docs.move_to_end(id(doc))

    @property
    def num_entries(self) -> int:
        return sum(len(found) for found in self.entries.values())


class SuffixProposer:
    """The two structures together: a row's proposal from whichever matches longer."""

    def __init__(self, config: SuffixConfig) -> None:
        self.config = config
        self.shared = SharedIndex(config)

    def request_index(self, tokens: list[int]) -> RequestIndex:
        return RequestIndex(tokens, self.config)

    def propose(self, index: RequestIndex, k: int) -> Proposal:
        own = index.propose(index.tokens, k)
        other = self.shared.propose(index.tokens, k)
        if other.match_len > own.match_len and other.tokens:
            self.shared.touch(other.source)
            return other
        return own

    def finished(self, output: Sequence[int]) -> None:
        """A request's output, for later requests to match."""
        self.shared.add(output)

"""Per-request grammar state and the bitmasks built from it.

A row's matcher is committed through the row's last emitted token. Masks for drafts and
verification advance it tentatively and roll it back: position i of a verification mask
is the state after the row's first i drafts, position K the bonus slot. A row whose
request set ``thinking_end`` starts in a thinking phase: it allows every token until
the marker's tokens have been emitted, then its grammar constrains the rest (the phase
is tracked per position, so drafts that cross the marker are masked after it). Rows that
an embedder flags ``Sequence.in_thinking_phase`` are neither masked nor advanced.

Greedy rows whose logprobs nobody reads are checked argmax first (``is_argmax_first``):
the argmax of the masked logits is the unmasked argmax whenever the grammar allows that
token (ties included: the first maximum stays the first among the allowed ones), so such
a row's mask is filled only where its grammar refuses the argmax.
"""

from __future__ import annotations

import logging
from concurrent.futures import Executor, Future
from typing import Any

import torch

from engine.sampling_params import SamplingParams
from engine.structured.bitmask import apply_bitmask, apply_bitmask_rows

logger = logging.getLogger(__name__)

ALL_ALLOWED = -1  # an int32 word with every bit set


def num_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


class RowGrammar:
    """One request's grammar matcher (xgrammar ``GrammarMatcher``), after an optional
    thinking phase that ends with the token sequence ``thinking_end``."""

    def __init__(self, matcher: Any, vocab_size: int, thinking_end: tuple[int, ...] = ()) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.num_refused = 0  # committed tokens the grammar did not allow (a stop token)
        self.thinking_end = thinking_end
        self.is_thinking = bool(thinking_end)
        self._num_matched = 0  # leading marker tokens that end the output so far
        # Per tentative token: the thinking state before it, or None (the matcher took it).
        self._trail: list[tuple[bool, int] | None] = []

    @property
    def is_terminated(self) -> bool:
        return bool(self.matcher.is_terminated())

    @property
    def is_masking(self) -> bool:
        """Whether its mask forbids anything now: past thinking, before the grammar's end."""
        return not self.is_thinking and not self.is_terminated

    def commit(self, tokens: list[int]) -> None:
        """Advances by emitted tokens (a FAULT id ends the list)."""
        for token in tokens:
            if token < 0 or self.is_terminated:
                return
            if self.is_thinking:
                self._think(token)
            elif not self.matcher.accept_token(token):
                self.num_refused += 1
                logger.debug("grammar: emitted token %d is not allowed", token)
                return

    def fill(self, out: torch.Tensor) -> None:
        """The allowed tokens now into ``out`` [W] int32 (a view of a contiguous CPU row);
        while thinking, and after the grammar's end (its stop token accepted), all."""
        if self.is_masking:
            self.matcher.fill_next_token_bitmask(out.view(1, -1), 0)
        else:
            out.fill_(ALL_ALLOWED)

    def allows(self, token: int) -> bool:
        """Whether ``token`` may come next (the state is left as it was)."""
        if not self.is_masking:
            return True
        if not self.matcher.accept_token(token):
            return False
        self.matcher.rollback(1)
        return True

    def try_advance(self, token: int) -> bool:
        """Tentatively past ``token`` (``rollback`` undoes it); False if it is forbidden."""
        if self.is_thinking:
            self._trail.append((True, self._num_matched))
            self._think(token)
            return True
        if self.is_terminated or not self.matcher.accept_token(token):
            return False
        self._trail.append(None)
        return True

    def rollback(self, num_tokens: int) -> None:
        """Undoes the last ``num_tokens`` successful ``try_advance`` calls."""
        if not num_tokens:
            return
        undone = self._trail[-num_tokens:]
        del self._trail[-num_tokens:]
        num_matcher = sum(entry is None for entry in undone)
        if num_matcher:
            self.matcher.rollback(num_matcher)
        thinking = next((entry for entry in undone if entry is not None), None)
        if thinking is not None:  # the earliest undone token was read while thinking
            self.is_thinking, self._num_matched = thinking

    def _think(self, token: int) -> None:
        """Marker matching: the longest marker prefix that ends the output."""
        end = self.thinking_end
        seen = (*end[: self._num_matched], token)
        n = min(len(seen), len(end))
        while n and seen[len(seen) - n :] != end[:n]:
            n -= 1
        self._num_matched = n
        if self._num_matched == len(end):
            self.is_thinking, self._num_matched = False, 0


def is_argmax_first(params: SamplingParams) -> bool:
    """Whether a row needs its mask only where its grammar refuses its argmax: greedy, and
    no logprobs (they are read from the masked logits)."""
    return params.is_greedy and params.logprobs is None


def active_rows(seqs: list[Any]) -> list[RowGrammar | None]:
    """Each row's grammar, None for rows without one or flagged in a thinking phase."""
    return [None if s.in_thinking_phase else s.grammar for s in seqs]


def fill_verify_bitmask(
    rows: list[RowGrammar | None], drafts: list[list[int]], out: torch.Tensor
) -> list[int]:
    """Fills ``out`` [B, K+1, W] (all allowed on entry) for verifying ``drafts`` [B][K];
    returns the flat positions (b * (K+1) + i) whose mask forbids anything. Positions
    after a draft the grammar refuses are never reached: left all allowed."""
    s = out.shape[1]
    masked: list[int] = []
    for b, row in enumerate(rows):
        if row is None:
            continue
        advanced = 0
        for i in range(s):
            if row.is_masking:
                row.fill(out[b, i])
                masked.append(b * s + i)
            if i == s - 1 or not row.try_advance(drafts[b][i]):
                break
            advanced += 1
        row.rollback(advanced)
    return masked


def fill_verify_refused(
    rows: list[RowGrammar | None],
    drafts: list[list[int]],
    logits: torch.Tensor,
    out: torch.Tensor,
) -> list[int]:
    """``fill_verify_bitmask`` for greedy rows, once the verification ``logits`` [B, K+1, V]
    are known: each row's positions are walked as greedy acceptance walks them (accept
    while the draft is the masked argmax), and position i is filled only if the grammar,
    after i drafts, refuses the argmax there. Positions past the first rejection are left
    all allowed: acceptance never reads them. Returns the flat positions filled."""
    s = out.shape[1]
    index = [b for b, row in enumerate(rows) if row is not None]
    if not index:
        return []
    argmaxes = logits[torch.tensor(index, device=logits.device)].argmax(dim=-1).tolist()
    masked: list[int] = []
    for b, argmax in zip(index, argmaxes, strict=True):
        row = rows[b]
        assert row is not None
        advanced = 0
        for i in range(s):
            token = argmax[i]
            if not row.allows(token):
                row.fill(out[b, i])
                masked.append(b * s + i)
                bits = out[b, i].to(logits.device)
                token = int(apply_bitmask(logits[b, i][None, None], bits[None, None]).argmax())
            if i == s - 1 or token != drafts[b][i] or not row.try_advance(token):
                break
            advanced += 1
        row.rollback(advanced)
    return masked


def verify_bitmask(
    rows: list[RowGrammar | None], drafts: list[list[int]], vocab_size: int
) -> torch.Tensor | None:
    """[B, K+1, W] int32 for verifying ``drafts`` [B][K] (None when no row has a grammar)."""
    if all(r is None for r in rows):
        return None
    k = len(drafts[0]) if drafts else 0
    mask = torch.full((len(rows), k + 1, num_words(vocab_size)), ALL_ALLOWED, dtype=torch.int32)
    fill_verify_bitmask(rows, drafts, mask)
    return mask


class SamplingMasks:
    """The masks of N rows about to sample one token each: filled on ``executor`` (while
    the forward runs; the matchers are the fill's until ``apply``) or here, except for
    rows whose ``params`` are argmax first (``is_argmax_first``), which ``greedy`` masks
    only where their grammar refuses their argmax."""

    def __init__(
        self,
        rows: list[RowGrammar | None],
        executor: Executor | None = None,
        params: list[SamplingParams] | None = None,
    ) -> None:
        self.rows = rows
        masking = [b for b, row in enumerate(rows) if row is not None and row.is_masking]
        first = [False] * len(rows) if params is None else [is_argmax_first(p) for p in params]
        self.masked = [b for b in masking if not first[b]]  # filled before sampling
        self.argmax_first = [b for b in masking if first[b]]  # filled if refused
        self._fill: Future[None] | None = None
        if not masking:
            return
        words = num_words(next(row.vocab_size for row in rows if row is not None))
        self.bitmask = torch.full((len(rows), words), ALL_ALLOWED, dtype=torch.int32)
        fills = [(rows[b], self.bitmask[b]) for b in self.masked]
        if not fills:
            return
        if executor is None:
            fill_rows(fills)
        else:
            self._fill = executor.submit(fill_rows, fills)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Sampling logits [N, V], in place: rows with a grammar restricted to what it
        allows now (argmax-first rows wait for ``greedy``); rows without one (or thinking,
        or done) are not touched."""
        if self._fill is not None:
            self._fill.result()
        if self.masked:
            apply_bitmask_rows(logits, self.bitmask.to(logits.device), self.masked)
        return logits

    def greedy(self, logits: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """The masked argmax [N] from the argmax ``chosen`` [N] of ``logits`` [N, V] (what
        greedy rows sample, after penalties): argmax-first rows whose grammar refuses their
        argmax get their mask (in place) and its argmax; other rows are left as they are."""
        if not self.argmax_first:
            return chosen
        index = torch.tensor(self.argmax_first, device=chosen.device)
        tokens = chosen[index].tolist()
        refused = [
            b
            for b, token in zip(self.argmax_first, tokens, strict=True)
            if not self._row(b).allows(token)
        ]
        if not refused:
            return chosen
        fill_rows([(self._row(b), self.bitmask[b]) for b in refused])
        apply_bitmask_rows(logits, self.bitmask.to(logits.device), refused)
        rows = torch.tensor(refused, device=chosen.device)
        return chosen.index_copy(0, rows, logits[rows].argmax(dim=-1))

    def _row(self, b: int) -> RowGrammar:
        row = self.rows[b]
        assert row is not None
        return row


def fill_rows(fills: list[tuple[Any, torch.Tensor]]) -> None:
    """Each (row, out [W]): the row's allowed tokens now."""
    for row, out in fills:
        row.fill(out)


def mask_logits(rows: list[RowGrammar | None], logits: torch.Tensor) -> torch.Tensor:
    """Sampling logits [N, V], in place: rows with a grammar restricted to what it allows
    now; rows without one (or thinking, or done) are not touched."""
    return SamplingMasks(rows).apply(logits)


def commit_rows(rows: list[RowGrammar | None], tokens: list[int]) -> None:
    """One sampled token per row."""
    for row, token in zip(rows, tokens, strict=True):
        if row is not None:
            row.commit([token])

"""Per-request grammar state and the bitmasks built from it.

A row's matcher is committed through the row's last emitted token. Masks for drafts and
verification advance it tentatively and roll it back: position i of a verification mask
is the state after the row's first i drafts, position K the bonus slot. Rows in a
thinking phase (``Sequence.in_thinking_phase``) are neither masked nor advanced.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from engine.structured.bitmask import apply_bitmask

logger = logging.getLogger(__name__)

ALL_ALLOWED = -1  # an int32 word with every bit set


def num_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


class RowGrammar:
    """One request's grammar matcher (xgrammar ``GrammarMatcher``)."""

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.num_refused = 0  # committed tokens the grammar did not allow (a stop token)

    @property
    def is_terminated(self) -> bool:
        return bool(self.matcher.is_terminated())

    def commit(self, tokens: list[int]) -> None:
        """Advances by emitted tokens (a FAULT id ends the list)."""
        for token in tokens:
            if token < 0 or self.is_terminated:
                return
            if not self.matcher.accept_token(token):
                self.num_refused += 1
                logger.debug("grammar: emitted token %d is not allowed", token)
                return

    def fill(self, out: torch.Tensor) -> None:
        """The allowed tokens now into ``out`` [W] int32 (a view of a contiguous CPU row);
        after the grammar's end (its stop token accepted) the row stops: no constraint."""
        if self.is_terminated:
            out.fill_(ALL_ALLOWED)
        else:
            self.matcher.fill_next_token_bitmask(out.view(1, -1), 0)

    def try_advance(self, token: int) -> bool:
        return bool(not self.is_terminated and self.matcher.accept_token(token))

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self.matcher.rollback(num_tokens)


def active_rows(seqs: list[Any]) -> list[RowGrammar | None]:
    """Each row's grammar, None for rows without one or in a thinking phase."""
    return [None if s.in_thinking_phase else s.grammar for s in seqs]


def verify_bitmask(
    rows: list[RowGrammar | None], drafts: list[list[int]], vocab_size: int
) -> torch.Tensor | None:
    """[B, K+1, W] int32 for verifying ``drafts`` [B][K] (None when no row has a grammar).
    Positions after a draft the grammar refuses are never reached: left all allowed."""
    if all(r is None for r in rows):
        return None
    k = len(drafts[0]) if drafts else 0
    mask = torch.full((len(rows), k + 1, num_words(vocab_size)), ALL_ALLOWED, dtype=torch.int32)
    for b, row in enumerate(rows):
        if row is None:
            continue
        advanced = 0
        for i in range(k + 1):
            row.fill(mask[b, i])
            if i == k or not row.try_advance(drafts[b][i]):
                break
            advanced += 1
        row.rollback(advanced)
    return mask


def mask_logits(rows: list[RowGrammar | None], logits: torch.Tensor) -> torch.Tensor:
    """Sampling logits [N, V] of rows with a grammar restricted to what it allows now."""
    if all(r is None for r in rows):
        return logits
    mask = torch.full((len(rows), num_words(logits.shape[-1])), ALL_ALLOWED, dtype=torch.int32)
    for b, row in enumerate(rows):
        if row is not None:
            row.fill(mask[b])
    return apply_bitmask(logits[:, None], mask[:, None].to(logits.device))[:, 0]


def commit_rows(rows: list[RowGrammar | None], tokens: list[int]) -> None:
    """One sampled token per row."""
    for row, token in zip(rows, tokens, strict=True):
        if row is not None:
            row.commit([token])

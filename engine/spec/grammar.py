"""The unified step's structured-output hook (``SpecStepInputs.grammar``): verification
masks from each row's drafts, accepted tokens committed, and drafts masked one by one."""

from __future__ import annotations

from typing import Any

import torch

from engine.spec.drafters import DraftLogits
from engine.structured.bitmask import apply_bitmask
from engine.structured.rows import (
    ALL_ALLOWED,
    RowGrammar,
    active_rows,
    num_words,
    verify_bitmask,
)


class StepGrammar:
    """The unified step's hook for rows with a grammar: commits accepted tokens (a host sync
    of those rows only) and masks each draft with the state after the drafts before it."""

    def __init__(self, rows: list[RowGrammar | None]) -> None:
        self.rows = rows
        self.indices = [b for b, r in enumerate(rows) if r is not None]
        self.vocab_size = next(r.vocab_size for r in rows if r is not None)
        self._advanced = [0] * len(rows)
        self._is_stuck = [False] * len(rows)  # a draft the grammar refuses (no allowed one)

    @classmethod
    def of(cls, seqs: list[Any]) -> StepGrammar | None:
        rows = active_rows(seqs)
        return cls(rows) if any(r is not None for r in rows) else None

    def accept(self, num_accepted: torch.Tensor, emitted: torch.Tensor) -> None:
        """Commits each grammar row's accepted drafts and next token."""
        index = torch.tensor(self.indices, device=emitted.device)
        nums = num_accepted[index].tolist()
        tokens = emitted[index].tolist()
        for b, num, row_tokens in zip(self.indices, nums, tokens, strict=True):
            row = self.rows[b]
            assert row is not None
            row.commit(row_tokens[: num + 1])

    def mask(self, scores: DraftLogits) -> DraftLogits:
        """The draft scores with tokens the rows' grammars refuse at -inf (a row with no
        allowed token the drafter can score keeps its scores: verification refuses it)."""
        mask = torch.full(
            (len(self.rows), num_words(self.vocab_size)), ALL_ALLOWED, dtype=torch.int32
        )
        for b in self.indices:
            row = self.rows[b]
            assert row is not None
            if not self._is_stuck[b]:
                row.fill(mask[b])
        mask = mask.to(scores.values.device)
        values = scores.values
        if scores.token_ids is None:
            masked = apply_bitmask(values[:, None], mask[:, None])[:, 0]
        else:
            ids = scores.token_ids
            bits = (mask[:, ids // 32] >> (ids % 32)) & 1  # [B, Vd]
            masked = values.masked_fill(bits == 0, float("-inf"))
        has_any = torch.isfinite(masked).any(dim=-1, keepdim=True)
        return DraftLogits(
            torch.where(has_any, masked, values), scores.token_ids, scores.vocab_size
        )

    def advance(self, drafts: torch.Tensor) -> None:
        """Each grammar row's state moves past its draft [B] (tentatively)."""
        index = torch.tensor(self.indices, device=drafts.device)
        for b, token in zip(self.indices, drafts[index].tolist(), strict=True):
            row = self.rows[b]
            assert row is not None
            if self._is_stuck[b]:
                continue
            if row.try_advance(token):
                self._advanced[b] += 1
            else:
                self._is_stuck[b] = True

    def end_drafts(self) -> None:
        """Back to the committed state."""
        for b in self.indices:
            row = self.rows[b]
            assert row is not None
            row.rollback(self._advanced[b])
            self._advanced[b] = 0
            self._is_stuck[b] = False


def step_fields(seqs: list[Any], drafts: list[list[int]], device: torch.device) -> dict[str, Any]:
    """``SpecStepInputs``' structured-output fields for a step verifying ``drafts``: empty
    when no row has a grammar (the step needs no host work then)."""
    grammar = StepGrammar.of(seqs)
    if grammar is None:
        return {}
    bitmask = verify_bitmask(grammar.rows, drafts, grammar.vocab_size)
    assert bitmask is not None
    return {
        "bitmask": bitmask.to(device),
        "in_thinking_phase": torch.tensor([s.in_thinking_phase for s in seqs], device=device),
        "grammar": grammar,
    }

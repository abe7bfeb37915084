"""The unified step's structured-output hook (``SpecStepInputs.grammar``): verification
masks from each row's drafts (filled on a worker thread while the target forward runs, or
for greedy rows after it, only where the grammar refuses the target's argmax), accepted
tokens committed, and drafts masked one by one."""

from __future__ import annotations

from concurrent.futures import Executor, Future
from typing import Any

import torch

from engine.spec.drafters import DraftLogits
from engine.structured.bitmask import apply_bitmask_rows
from engine.structured.rows import (
    ALL_ALLOWED,
    RowGrammar,
    active_rows,
    fill_verify_bitmask,
    fill_verify_refused,
    is_argmax_first,
    num_words,
)


class StepGrammar:
    """The unified step's hook for rows with a grammar: their verification masks, then
    commits accepted tokens (a host sync of those rows only) and masks each draft with the
    state after the drafts before it. Only rows whose grammar forbids something are masked;
    rows flagged ``argmax_first`` only at the positions where it refuses the target's argmax
    (``fill_verify_refused``)."""

    def __init__(
        self, rows: list[RowGrammar | None], argmax_first: list[bool] | None = None
    ) -> None:
        self.rows = rows
        self.indices = [b for b, r in enumerate(rows) if r is not None]
        first = argmax_first or [False] * len(rows)
        # Rows whose verification masks wait for the logits, and the others.
        self._after = [r if first[b] else None for b, r in enumerate(rows)]
        self._before = [None if first[b] else r for b, r in enumerate(rows)]
        self._drafts: list[list[int]] = []
        self.vocab_size = next(r.vocab_size for r in rows if r is not None)
        self._advanced = [0] * len(rows)
        self._is_stuck = [False] * len(rows)  # a draft the grammar refuses (no allowed one)
        self._verify: Future[list[int]] | None = None
        self._bitmask: torch.Tensor | None = None

    @classmethod
    def of(cls, seqs: list[Any]) -> StepGrammar | None:
        rows = active_rows(seqs)
        if all(r is None for r in rows):
            return None
        # Acceptance penalizes the masked logits: the walk reads unpenalized argmaxes.
        first = [is_argmax_first(s.params) and not s.params.uses_penalties for s in seqs]
        return cls(rows, first)

    def start_verify(self, drafts: list[list[int]], executor: Executor | None = None) -> None:
        """Starts filling the masks for verifying ``drafts`` [B][K] on ``executor`` (None:
        here and now), but argmax-first rows'; the matchers are the fill's until
        ``verify_mask`` returns."""
        self._drafts = drafts
        k = len(drafts[0]) if drafts else 0
        self._bitmask = torch.full(
            (len(self.rows), k + 1, num_words(self.vocab_size)), ALL_ALLOWED, dtype=torch.int32
        )
        if executor is None:
            done: Future[list[int]] = Future()
            done.set_result(fill_verify_bitmask(self._before, drafts, self._bitmask))
            self._verify = done
        else:
            self._verify = executor.submit(fill_verify_bitmask, self._before, drafts, self._bitmask)

    def verify_mask(self, logits: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        """The verification bitmask [B, K+1, W] on the device of ``logits`` [B, K+1, V] (the
        target's, unmasked) and the flat positions it masks (b * (K+1) + i), once the fill
        is done and argmax-first rows are walked."""
        assert self._verify is not None and self._bitmask is not None, "start_verify first"
        masked = self._verify.result()
        masked += fill_verify_refused(self._after, self._drafts, logits, self._bitmask)
        return self._bitmask.to(logits.device, non_blocking=True), sorted(masked)

    def accept(self, num_accepted: torch.Tensor, emitted: torch.Tensor) -> None:
        """Commits each grammar row's accepted drafts and next token."""
        index = torch.tensor(self.indices, device=emitted.device)
        nums = num_accepted[index].tolist()
        tokens = emitted[index].tolist()
        for b, num, row_tokens in zip(self.indices, nums, tokens, strict=True):
            row = self.rows[b]
            assert row is not None
            row.commit(row_tokens[: num + 1])

    def argmax(self, scores: DraftLogits) -> torch.Tensor:
        """Greedy drafts [B]: the argmax of the masked scores. A row's unmasked argmax that
        its grammar allows is that already (ties included: the first maximum), so only
        rows whose argmax is refused pay for a mask (a fill per state is the cost)."""
        chosen = scores.argmax()
        index = torch.tensor(self.indices, device=chosen.device)
        tokens = chosen[index].tolist()
        refused = [
            b
            for b, token in zip(self.indices, tokens, strict=True)
            if not self._is_stuck[b] and not self._row(b).allows(token)
        ]
        if not refused:
            return chosen
        again = self.mask(scores, refused).argmax()
        rows = torch.tensor(refused, device=chosen.device)
        return chosen.index_copy(0, rows, again[rows])

    def mask(self, scores: DraftLogits, rows: list[int] | None = None) -> DraftLogits:
        """The draft scores with tokens the rows' grammars refuse at -inf (a row with no
        allowed token the drafter can score keeps its scores: verification refuses it);
        ``rows``: only those (default: every grammar row)."""
        candidates = self.indices if rows is None else rows
        rows = [b for b in candidates if not self._is_stuck[b] and self._row(b).is_masking]
        if not rows:
            return scores
        mask = torch.full((len(rows), num_words(self.vocab_size)), ALL_ALLOWED, dtype=torch.int32)
        for i, b in enumerate(rows):
            self._row(b).fill(mask[i])
        values = scores.values
        mask = mask.to(values.device)
        index = torch.tensor(rows, device=values.device)
        sub = values[index]  # [G, Vd], a copy: only the masked rows
        if scores.token_ids is None:
            apply_bitmask_rows(sub, mask, list(range(len(rows))))
        else:
            ids = scores.token_ids
            bits = (mask[:, ids // 32] >> (ids % 32)) & 1  # [G, Vd]
            sub = sub.masked_fill(bits == 0, float("-inf"))
        has_any = torch.isfinite(sub).any(dim=-1, keepdim=True)
        masked = values.index_copy(0, index, torch.where(has_any, sub, values[index]))
        return DraftLogits(masked, scores.token_ids, scores.vocab_size)

    def advance(self, drafts: torch.Tensor) -> None:
        """Each grammar row's state moves past its draft [B] (tentatively)."""
        index = torch.tensor(self.indices, device=drafts.device)
        for b, token in zip(self.indices, drafts[index].tolist(), strict=True):
            if self._is_stuck[b]:
                continue
            if self._row(b).try_advance(token):
                self._advanced[b] += 1
            else:
                self._is_stuck[b] = True

    def end_drafts(self) -> None:
        """Back to the committed state."""
        for b in self.indices:
            self._row(b).rollback(self._advanced[b])
            self._advanced[b] = 0
            self._is_stuck[b] = False

    def _row(self, b: int) -> RowGrammar:
        row = self.rows[b]
        assert row is not None
        return row


def step_fields(
    seqs: list[Any], drafts: list[list[int]], device: torch.device, executor: Executor | None = None
) -> dict[str, Any]:
    """``SpecStepInputs``' structured-output fields for a step verifying ``drafts``: empty
    when no row has a grammar (the step needs no host work then). The verification masks
    are filled on ``executor`` while the step's target forward runs."""
    grammar = StepGrammar.of(seqs)
    if grammar is None:
        return {}
    grammar.start_verify(drafts, executor)
    return {
        "in_thinking_phase": torch.tensor([s.in_thinking_phase for s in seqs], device=device),
        "grammar": grammar,
    }

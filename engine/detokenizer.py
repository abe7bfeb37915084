"""Incremental detokenization that never emits half a character or half a stop string."""

from __future__ import annotations

from typing import Any


class IncrementalDetokenizer:
    """Follows one request's output tokens and yields text that is safe to show."""

    def __init__(self, tokenizer: Any, stop: tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.output_ids: list[int] = []
        self.text = ""  # text emitted so far
        self.stopped_on: str | None = None  # the stop string found, if any

    def add(self, token_ids: list[int], *, final: bool = False) -> str:
        """Appends tokens; returns the newly emitted text. ``final`` flushes held-back text."""
        self.output_ids.extend(token_ids)
        decoded: str = self.tokenizer.decode(self.output_ids, skip_special_tokens=True)
        if self.stop:
            search_from = max(0, len(self.text) - max(len(s) for s in self.stop) + 1)
            hits = [(decoded.find(s, search_from), s) for s in self.stop]
            hits = [(i, s) for i, s in hits if i >= 0]
            if hits:
                index, self.stopped_on = min(hits)
                return self._emit(decoded[:index])
        stable = decoded
        if not final:
            stable = stable.rstrip("\ufffd")  # an incomplete UTF-8 sequence: wait for more
            if self.stop:
                stable = stable[: len(stable) - self._partial_stop_len(stable)]
        return self._emit(stable)

    def _partial_stop_len(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that begins some stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best

    def _emit(self, stable: str) -> str:
        if len(stable) <= len(self.text) or not stable.startswith(self.text):
            return ""
        delta = stable[len(self.text) :]
        self.text = stable
        return delta

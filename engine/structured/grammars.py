"""The engine's side of structured output: one compiler per engine (made on the first
constrained request), a grammar row per constrained request."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from engine.sampling_params import GrammarError, StructuredOutput
from engine.structured.compiler import GrammarCompiler
from engine.structured.rows import RowGrammar


class Grammars:
    """Rows for requests' constraints; ``timeout_s`` and ``cache_size`` bound compiling."""

    def __init__(
        self,
        model_dir: str,
        tokenizer: Any | None,
        vocab_size: int,
        stop_token_ids: Iterable[int],
        *,
        timeout_s: float,
        cache_size: int,
    ) -> None:
        self.model_dir, self.tokenizer = model_dir, tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self.timeout_s, self.cache_size = timeout_s, cache_size
        self._compiler: GrammarCompiler | None = None

    @property
    def compiler(self) -> GrammarCompiler:
        if self._compiler is None:
            if self.tokenizer is None:
                from transformers import AutoTokenizer

                self.tokenizer = AutoTokenizer.from_pretrained(str(self.model_dir))
            try:
                self._compiler = GrammarCompiler(
                    self.tokenizer,
                    self.vocab_size,
                    self.stop_token_ids,
                    timeout_s=self.timeout_s,
                    cache_size=self.cache_size,
                )
            except ImportError as e:
                raise GrammarError(f"structured_output: needs xgrammar ({e})") from None
        return self._compiler

    def row(self, spec: StructuredOutput | None, generated: list[int]) -> RowGrammar | None:
        """A request's grammar, advanced past output an earlier attempt generated (a
        resumed request, or a decode worker continuing a prefill worker's output)."""
        if spec is None:
            return None
        matcher = self.compiler.matcher(spec)
        row = RowGrammar(matcher, self.vocab_size, self.thinking_end_ids(spec.thinking_end))
        row.commit(generated)
        return row

    def thinking_end_ids(self, marker: str) -> tuple[int, ...]:
        """The marker's tokens, the text tokenized alone (a special token such as
        ``</think>`` is one id); () for no marker."""
        if not marker:
            return ()
        _ = self.compiler  # loads the tokenizer
        assert self.tokenizer is not None
        ids = tuple(self.tokenizer.encode(marker, add_special_tokens=False))
        if not ids:
            raise GrammarError(f"structured_output.thinking_end: {marker!r} has no tokens")
        return ids

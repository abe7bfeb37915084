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
            tokenizer = self.tokenizer
            if tokenizer is None:
                from transformers import AutoTokenizer

                tokenizer = AutoTokenizer.from_pretrained(str(self.model_dir))
            try:
                self._compiler = GrammarCompiler(
                    tokenizer,
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
        row = RowGrammar(self.compiler.matcher(spec), self.vocab_size)
        row.commit(generated)
        return row

"""Compiles constraints once per (kind, value) for one tokenizer, with a bounded LRU cache
and a compile deadline."""

from __future__ import annotations

import concurrent.futures
import threading
from collections import OrderedDict
from typing import Any

from engine.sampling_params import GrammarError, StructuredOutput

DEFAULT_COMPILE_TIMEOUT_S = 10.0
DEFAULT_CACHE_SIZE = 64


class GrammarCompiler:
    """xgrammar compiled grammars for one tokenizer and vocabulary size. A compile that
    overruns ``timeout_s`` is refused (GrammarError); its thread finishes in the background
    (xgrammar cannot be interrupted) and its result is dropped."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: list[int],
        *,
        timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S,
        cache_size: int = DEFAULT_CACHE_SIZE,
    ) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self.vocab_size = vocab_size
        self.timeout_s = timeout_s
        self.cache_size = cache_size
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_token_ids)
        )
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        # Keyed by what compiles: (kind, value), not the thinking_end marker.
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._lock = threading.Lock()
        self.num_compiled = 0

    def compile(self, spec: StructuredOutput) -> Any:
        """The compiled grammar of ``spec`` (cached); GrammarError naming the problem."""
        key = (spec.kind, spec.value)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        # A thread per compile: one that overruns keeps only itself busy, not later ones.
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        thread = threading.Thread(
            target=self._compile_into, args=(spec, future), name="grammar", daemon=True
        )
        thread.start()
        try:
            compiled = future.result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError:
            raise GrammarError(
                f"{spec.field}: did not compile within {self.timeout_s:g} s; simplify it"
            ) from None
        except RuntimeError as e:  # xgrammar's parse and conversion errors
            raise GrammarError(f"{spec.field}: {_first_line(e)}") from None
        with self._lock:
            self.num_compiled += 1
            self._cache[key] = compiled
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return compiled

    def _compile_into(self, spec: StructuredOutput, future: concurrent.futures.Future[Any]) -> None:
        try:
            future.set_result(self._compile(spec))
        except BaseException as e:  # handed to the caller, which raises it
            future.set_exception(e)

    def _compile(self, spec: StructuredOutput) -> Any:
        c = self._compiler
        if spec.kind == "json":
            return c.compile_builtin_json_grammar()
        if spec.kind == "json_schema":
            return c.compile_json_schema(spec.value, any_whitespace=False)
        if spec.kind == "regex":
            return c.compile_regex(spec.value)
        return c.compile_grammar(spec.value)

    def matcher(self, spec: StructuredOutput) -> Any:
        """A fresh matcher (xgrammar keeps its whole history: rollbacks are unbounded)."""
        return self._xgr.GrammarMatcher(self.compile(spec))


def _first_line(e: Exception) -> str:
    """xgrammar's message without its ``[time] file:line:`` prefix."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if text.startswith("[") and ": " in text:
        parts = text.split(": ", 1)
        if ".cc:" in parts[0] or ".h:" in parts[0]:
            return parts[1]
    return text

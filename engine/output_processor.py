"""A request's output assembled from the engine's deltas, off the engine's thread.

The engine hands out what each step added to a request (``RequestDelta``). Whoever holds
the request keeps its ``OutputBuilder``: the whole output so far, its logprobs, and its
text, made by an ``IncrementalDetokenizer`` where there is a tokenizer. That is also
where stop strings are found. The engine never sees them, so a request that one ends is
still running there: its holder drops it (``LLMEngine.drop_request``), a step or two late,
and the tokens the engine made past the stop string are left out of the output, as are
any a step made past the token that ended it. On a worker, builders run in the event
loop; offline, ``OutputProcessor`` keeps one per request for ``LLMEngine.step``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from engine.detokenizer import IncrementalDetokenizer
from engine.outputs import RequestDelta, RequestOutput, RequestStart
from engine.sequence import FinishReason, SpecCounts, TokenLogprobs


class OutputBuilder:
    """One request's output, from its deltas (see the module's docstring)."""

    def __init__(self, request_id: str, start: RequestStart, tokenizer: Any | None) -> None:
        self.request_id = request_id
        self.prompt_token_ids = start.prompt_token_ids
        self.params = start.params
        self.token_ids = list(start.output_token_ids_sent)
        self.logprobs: list[TokenLogprobs] = []
        self.prompt_logprobs: list[TokenLogprobs] | None = None
        self.finish_reason: FinishReason | None = None
        self.stop_reason: int | str | None = None
        self.num_cached_tokens = 0
        self.spec_counts: SpecCounts | None = None
        self.is_ended_here = False  # a stop string ended it: the engine still runs it
        self._detok: IncrementalDetokenizer | None = None
        if tokenizer is not None:
            self._detok = IncrementalDetokenizer(tokenizer, start.params.stop)
            if self.token_ids:
                self._detok.add(self.token_ids)  # an earlier attempt's: it did not stop there

    @property
    def text(self) -> str:
        """The output's text so far ("" without a tokenizer): whole characters, a stop
        string and what may begin one held back."""
        return self._detok.text if self._detok is not None else ""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def take(self, delta: RequestDelta) -> bool:
        """Takes one delta of this request; False once it ended (the engine goes on for a
        step or two after a stop string: those tokens are dropped). ``output`` makes the
        output, once for however many deltas were taken."""
        if self.finished:
            return False
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        self.num_cached_tokens = delta.num_cached_tokens
        self.spec_counts = delta.spec_counts
        last = len(delta.new_token_ids) - 1
        for i, token in enumerate(delta.new_token_ids):
            self.token_ids.append(token)
            if i < len(delta.new_logprobs):
                self.logprobs.append(delta.new_logprobs[i])
            is_final = delta.finished and i == last  # the token the engine ended it on
            if self._detok is None:
                continue
            self._detok.add([token], final=is_final)
            if self._detok.stopped_on is not None and not is_final:
                self.finish_reason, self.stop_reason = FinishReason.STOP, self._detok.stopped_on
                self.is_ended_here = True
                return True
        if delta.finished:
            self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason
        return True

    def output(self) -> RequestOutput:
        """The output so far: every output token and its text (copies)."""
        return RequestOutput(
            request_id=self.request_id,
            prompt_token_ids=self.prompt_token_ids,
            token_ids=list(self.token_ids),
            text=self.text,
            finished=self.finished,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            num_cached_tokens=self.num_cached_tokens,
            logprobs=list(self.logprobs),
            spec_counts=dataclasses.replace(self.spec_counts) if self.spec_counts else None,
            prompt_logprobs=self.prompt_logprobs,
        )


class OutputProcessor:
    """The builders of many requests, each made from its request's first delta (which
    carries its start) and forgotten once it ended: what one caller of an engine that
    steps it itself needs (the offline ``LLMEngine.step``)."""

    def __init__(self, tokenizer: Any | None) -> None:
        self.tokenizer = tokenizer
        self._builders: dict[str, OutputBuilder] = {}

    def process(self, deltas: Iterable[RequestDelta]) -> list[RequestOutput]:
        """The outputs the deltas make, one per delta of a request not yet ended."""
        outputs = []
        for delta in deltas:
            rid = delta.request_id
            if delta.start is not None:
                self._builders[rid] = OutputBuilder(rid, delta.start, self.tokenizer)
            builder = self._builders.get(rid)
            if builder is None or not builder.take(delta):
                continue
            output = builder.output()
            outputs.append(output)
            if output.finished:
                del self._builders[rid]
        return outputs

    def forget(self, request_id: str) -> None:
        self._builders.pop(request_id, None)

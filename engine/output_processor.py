"""What a step's sampled tokens do to their requests, and the output each request gets.

A token is appended to its sequence, with its logprobs where the request asks for them,
and checked against what ends the request: a stop token or EOS, max_tokens, and, where the
engine has a tokenizer, a stop string in the text detokenized so far (each request keeps
an ``IncrementalDetokenizer``). The engine's loop decides what happens to a request that
ended (its blocks, its drafter state); this module only says that it ended, and why.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Set as AbstractSet
from typing import Any

from engine.detokenizer import IncrementalDetokenizer
from engine.model_runner import RowLogprobs
from engine.outputs import RequestOutput
from engine.sampler import FAULT
from engine.sampling_params import SamplingParams
from engine.sequence import FinishReason, Sequence, TokenLogprobs


class OutputProcessor:
    """Appends tokens to sequences, ends them, and builds their ``RequestOutput``s (see
    the module's docstring); holds each live request's detokenizer."""

    def __init__(
        self, eos_token_ids: AbstractSet[int], tokenizer: Any | None, *, has_spec: bool
    ) -> None:
        self.eos_token_ids = eos_token_ids
        self.tokenizer = tokenizer
        self.has_spec = has_spec  # outputs carry speculative counters
        self._detok: dict[str, IncrementalDetokenizer] = {}

    def start(self, request_id: str, params: SamplingParams, output_ids: list[int]) -> None:
        """A new request (``output_ids``: output an earlier attempt already generated)."""
        if self.tokenizer is None:
            return
        detok = self._detok[request_id] = IncrementalDetokenizer(self.tokenizer, params.stop)
        if output_ids:
            detok.add(output_ids)  # an earlier attempt's output: it did not stop there

    def forget(self, request_id: str) -> None:
        self._detok.pop(request_id, None)

    def text(self, request_id: str) -> str:
        """The request's output text so far ("" without a tokenizer)."""
        detok = self._detok.get(request_id)
        return detok.text if detok is not None else ""

    def append(self, seq: Sequence, token: int, logprobs: RowLogprobs | None) -> None:
        """One sampled token of ``seq`` (FAULT: its logits were not finite, and it alone
        ends with FinishReason.ERROR), its logprobs where the request asks for them."""
        if token == FAULT:
            seq.finish_reason = FinishReason.ERROR
            return
        seq.token_ids.append(token)
        if logprobs is not None and seq.params.logprobs is not None:
            chosen, ids, values = logprobs
            n = seq.params.logprobs
            top = dict(zip(ids[:n], values[:n], strict=True))
            seq.logprobs.append(TokenLogprobs(token, chosen, top))
        self.check_stop(seq, token)

    def check_stop(self, seq: Sequence, token: int) -> None:
        """Ends ``seq`` if its last token ``token`` ends it (see the module's docstring)."""
        params = seq.params
        # A grammar allows EOS only where it ends: its rows end there even with ignore_eos
        # (not while thinking: the grammar does not constrain that part yet).
        is_grammar_end = seq.grammar is not None and not seq.grammar.is_thinking
        is_eos = (not params.ignore_eos or is_grammar_end) and token in self.eos_token_ids
        if token in params.stop_token_ids or is_eos:
            seq.finish_reason, seq.stop_reason = FinishReason.STOP, token
        elif seq.num_output_tokens >= params.max_tokens:
            seq.finish_reason = FinishReason.LENGTH
        detok = self._detok.get(seq.request_id)
        if detok is not None:
            detok.add([token], final=seq.finish_reason is not None)
            if detok.stopped_on is not None and seq.finish_reason is None:
                seq.finish_reason, seq.stop_reason = FinishReason.STOP, detok.stopped_on

    def output(self, seq: Sequence) -> RequestOutput:
        """The request's output so far: every output token and its text."""
        return RequestOutput(
            request_id=seq.request_id,
            prompt_token_ids=seq.token_ids[: seq.num_prompt_tokens],
            token_ids=seq.output_token_ids,
            text=self.text(seq.request_id),
            finished=seq.finish_reason is not None,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
            num_cached_tokens=seq.num_cached_tokens,
            logprobs=list(seq.logprobs),
            spec_counts=dataclasses.replace(seq.spec_counts) if self.has_spec else None,
            prompt_logprobs=seq.prompt_logprobs if seq.params.prompt_logprobs is not None else None,
        )

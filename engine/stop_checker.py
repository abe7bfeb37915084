"""What a step's sampled tokens do to their requests, on the engine's thread.

A token is appended to its sequence, with its logprobs where the request asks for them,
and checked against what ends the request here: a stop token or EOS, and max_tokens.
Stop strings are not: they are found in the text, which the engine does not make (see
``engine.output_processor``). The engine's loop decides what happens to a request that
ended (its blocks, its drafter state); this module only says that it ended, and why.
"""

from __future__ import annotations

from collections.abc import Set as AbstractSet

from engine.model_runner import RowLogprobs
from engine.sampler import FAULT
from engine.sequence import FinishReason, Sequence, TokenLogprobs


class StopChecker:
    """Appends tokens to sequences and ends them (see the module's docstring)."""

    def __init__(self, eos_token_ids: AbstractSet[int]) -> None:
        self.eos_token_ids = eos_token_ids

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
        self.check(seq, token)

    def check(self, seq: Sequence, token: int) -> None:
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

"""What the engine hands out, and what its callers make of it.

Each step, the engine hands out one ``RequestDelta`` per request that it changed: the
tokens it added (with their logprobs), and whether and why the request ended there. It
does not detokenize: whoever holds the request (a worker's event loop, or the offline
caller) assembles its deltas into a ``RequestOutput`` (``engine.output_processor``), which
holds the whole output so far, its text, and the stop strings found in it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from engine.sampling_params import SamplingParams
from engine.sequence import FinishReason, Sequence, SpecCounts, TokenLogprobs

# FinishReason.ERROR: why the engine ended a request alone (the rest of its batch went on)
NON_FINITE_LOGITS = (
    "engine: the model's logits for this request were not finite (NaN or inf), so no token "
    "could be sampled; the request was ended (the other requests in its batch went on)"
)


class RequestFailed(Exception):
    """The engine ended this one request with FinishReason.ERROR (INTERNAL, with this
    message: it says what failed, and holds nothing of another request)."""


@dataclass
class PrefilledRequest:
    """What a prefill worker hands on: where the KV sits and what decoding starts from."""

    request_id: str
    block_table: list[int]  # this worker's blocks holding the prompt's target (+draft) KV
    num_prompt_tokens: int
    first_token: int
    draft_token_ids: list[int]  # empty without speculation
    seed: int  # the request's seed, so the decode side samples the same tokens


@dataclass
class RequestStart:
    """What a request's first delta carries, so that its outputs can be assembled by one
    who did not add it (the offline ``LLMEngine.step``)."""

    prompt_token_ids: list[int]
    params: SamplingParams
    output_token_ids_sent: list[int]  # output an earlier attempt generated (a resumed request)


@dataclass
class RequestDelta:
    """What one engine step did to one request: the output tokens it added, and whether
    it ended the request. The engine ends a request on a stop token, EOS, max_tokens, a
    fault, a preemption; never on a stop string, which only its text shows."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs]  # one per new token where the request asks for them
    finish_reason: FinishReason | None = None
    stop_reason: int | None = None  # the stop token id that ended it
    num_cached_tokens: int = 0
    spec_counts: SpecCounts | None = None  # a copy; None when the engine runs without a draft
    # On the request's first delta: its prompt logprobs (SamplingParams.prompt_logprobs),
    # complete by then, and its start.
    prompt_logprobs: list[TokenLogprobs] | None = None
    start: RequestStart | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # all output tokens so far
    text: str  # all output text so far (stop string and partial characters held back)
    finished: bool
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    spec_counts: SpecCounts | None = None  # a copy; None when the engine runs without a draft
    # SamplingParams.prompt_logprobs: prompt tokens 1..P-1 (the first has none), complete
    # once the prompt is computed; None when not asked.
    prompt_logprobs: list[TokenLogprobs] | None = None


def hand_out(seq: Sequence, *, has_spec: bool) -> RequestDelta:
    """What ``seq`` gained since its last delta (its speculative counters where
    ``has_spec``); the first also carries its start and its prompt's logprobs (complete
    by then)."""
    params = seq.params
    delta = RequestDelta(
        request_id=seq.request_id,
        new_token_ids=seq.token_ids[seq.num_tokens_handed_out :],
        new_logprobs=seq.logprobs[seq.num_logprobs_handed_out :],
        finish_reason=seq.finish_reason,
        stop_reason=seq.stop_reason,
        num_cached_tokens=seq.num_cached_tokens,
        spec_counts=dataclasses.replace(seq.spec_counts) if has_spec else None,
    )
    if not seq.has_handed_out:
        seq.has_handed_out = True
        num_prompt = seq.num_prompt_tokens
        sent = seq.token_ids[num_prompt : seq.num_tokens_handed_out]
        delta.start = RequestStart(seq.token_ids[:num_prompt], params, sent)
        if params.prompt_logprobs is not None:
            delta.prompt_logprobs = seq.prompt_logprobs
    seq.num_tokens_handed_out = seq.num_tokens
    seq.num_logprobs_handed_out = len(seq.logprobs)
    return delta

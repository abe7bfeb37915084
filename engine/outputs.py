"""What the engine hands out: a request's output so far, and a prefilled request."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.sequence import FinishReason, SpecCounts, TokenLogprobs

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

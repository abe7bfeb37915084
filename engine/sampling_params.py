"""Per-request sampling parameters, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_STOP_SEQUENCES = 16
MAX_LOGPROBS = 20


class SamplingParamsError(ValueError):
    """A sampling parameter out of range; the message names it."""


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token. ``temperature == 0`` means greedy."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0  # 0: no top-k
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None  # None: a fresh seed per request
    stop: tuple[str, ...] = field(default=())
    stop_token_ids: tuple[int, ...] = field(default=())
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top alternatives to return with each token

    def __post_init__(self) -> None:
        # Accept lists from callers, keep tuples (frozen, hashable).
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise SamplingParamsError(
                f"max_tokens: must be an integer >= 1, got {self.max_tokens!r}"
            )
        if not 0.0 <= self.temperature <= 100.0:
            raise SamplingParamsError(f"temperature: must be in [0, 100], got {self.temperature}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise SamplingParamsError(
                f"top_k: must be an integer >= 0 (0 disables), got {self.top_k!r}"
            )
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingParamsError(f"top_p: must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise SamplingParamsError(f"min_p: must be in [0, 1], got {self.min_p}")
        if self.seed is not None and not (isinstance(self.seed, int) and 0 <= self.seed < 2**63):
            raise SamplingParamsError(f"seed: must be an integer in [0, 2**63), got {self.seed!r}")
        if len(self.stop) > MAX_STOP_SEQUENCES:
            raise SamplingParamsError(
                f"stop: at most {MAX_STOP_SEQUENCES} stop strings, got {len(self.stop)}"
            )
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise SamplingParamsError("stop: every stop string must be a non-empty string")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise SamplingParamsError(
                f"stop_token_ids: must be token ids >= 0, got {self.stop_token_ids}"
            )
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise SamplingParamsError(
                f"logprobs: must be in [0, {MAX_LOGPROBS}], got {self.logprobs}"
            )

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

"""Per-request sampling parameters, validated on construction."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

MAX_STOP_SEQUENCES = 16
MAX_THINKING_END = 64  # characters of StructuredOutput.thinking_end
MAX_LOGPROBS = 20
MAX_PROMPT_LOGPROBS = 20
MAX_FREQUENCY_PENALTY = 2.0  # frequency_penalty and presence_penalty in [-2, 2], as OpenAI's
MAX_REPETITION_PENALTY = 100.0  # repetition_penalty in (0, 100]; 1 is off
MAX_LOGIT_BIAS = 100.0  # each logit_bias value in [-100, 100], as OpenAI's
MAX_LOGIT_BIAS_ENTRIES = 300

LogitBias = tuple[tuple[int, float], ...]  # (token id, bias) pairs, ids ascending

MIN_TEMPERATURE = 1e-5  # a smaller one samples greedily (see is_greedy)


class SamplingParamsError(ValueError):
    """A sampling parameter out of range; the message names it."""


STRUCTURED_KINDS = ("json", "json_schema", "regex", "grammar")


class GrammarError(SamplingParamsError):
    """A constraint that is malformed, does not compile or not in time; the message names
    the field."""


@dataclass(frozen=True)
class StructuredOutput:
    """``kind``: "json" (any JSON object), "json_schema" (``value`` a JSON schema),
    "regex" or "grammar" (``value`` EBNF in GBNF style, root rule ``root``). With
    ``thinking_end`` (a reasoning model's end-of-thinking marker), the output is free until
    it contains the marker's tokens, and constrained after them."""

    kind: str
    value: str = ""
    thinking_end: str = ""

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise GrammarError(
                f"structured_output: kind {self.kind!r} is not one of {', '.join(STRUCTURED_KINDS)}"
            )
        if self.kind != "json" and not self.value:
            raise GrammarError(f"{self.field}: is empty")
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.value)
            except ValueError as e:
                raise GrammarError(f"{self.field}: is not valid JSON ({e})") from None
            if not isinstance(schema, (dict, bool)):
                raise GrammarError(f"{self.field}: must be a JSON object")
        if len(self.thinking_end) > MAX_THINKING_END:
            raise GrammarError(
                f"structured_output.thinking_end: at most {MAX_THINKING_END} characters, "
                f"got {len(self.thinking_end)}"
            )

    @property
    def field(self) -> str:
        """The wire's field that carries it (tandem.v1.StructuredOutput), for errors."""
        name = "json_object" if self.kind == "json" else self.kind
        return f"structured_output.{name}"


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
    # Each prompt token's logprob given the ones before it (none for the first), plus this
    # many top alternatives; None: off. With it set, max_tokens may be 0 (score the prompt).
    prompt_logprobs: int | None = None
    # Penalties and bias change the distribution sampled from (``engine.sampler.penalized``):
    # frequency and presence count the output's tokens, repetition the prompt's too.
    frequency_penalty: float = 0.0  # minus this times a token's count in the output
    presence_penalty: float = 0.0  # minus this for a token in the output at all
    repetition_penalty: float = 1.0  # divides positive logits of seen tokens, multiplies others
    # Added to the logits: token id -> bias; a mapping or (id, bias) pairs, kept as sorted pairs.
    logit_bias: Mapping[int, float] | Iterable[tuple[int, float]] = field(default=())
    # Output restricted to a JSON schema, regex or grammar (engine.structured); None: free.
    structured_output: StructuredOutput | None = None
    # False: this request's rows verify no drafts (K = 0) in whatever batch they run, and
    # emit exactly what decoding without a draft would (the same draws, seeded or not).
    speculative: bool = True

    def __post_init__(self) -> None:
        # Accept lists from callers, keep tuples (frozen, hashable).
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        bias = self.logit_bias
        try:
            pairs = dict(bias.items() if isinstance(bias, Mapping) else bias)  # a later id wins
        except (TypeError, ValueError):
            raise SamplingParamsError(
                f"logit_bias: must map token ids to biases, got {bias!r}"[:200]
            ) from None
        object.__setattr__(self, "logit_bias", tuple(pairs.items()))
        min_tokens = 0 if self.prompt_logprobs is not None else 1
        if not isinstance(self.max_tokens, int) or self.max_tokens < min_tokens:
            raise SamplingParamsError(
                f"max_tokens: must be an integer >= {min_tokens}, got {self.max_tokens!r}"
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
        prompt = self.prompt_logprobs
        if prompt is not None and not 0 <= prompt <= MAX_PROMPT_LOGPROBS:
            raise SamplingParamsError(
                f"prompt_logprobs: must be in [0, {MAX_PROMPT_LOGPROBS}], got {prompt}"
            )
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not -MAX_FREQUENCY_PENALTY <= value <= MAX_FREQUENCY_PENALTY:
                raise SamplingParamsError(
                    f"{name}: must be in [-{MAX_FREQUENCY_PENALTY:g}, "
                    f"{MAX_FREQUENCY_PENALTY:g}], got {value}"
                )
        if not 0.0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise SamplingParamsError(
                f"repetition_penalty: must be in (0, {MAX_REPETITION_PENALTY:g}] (1 is off), "
                f"got {self.repetition_penalty}"
            )
        self._check_logit_bias()

    def _check_logit_bias(self) -> None:
        """Refuses a bad logit_bias, and keeps a good one as pairs sorted by token id."""
        if len(self.bias_pairs) > MAX_LOGIT_BIAS_ENTRIES:
            raise SamplingParamsError(
                f"logit_bias: at most {MAX_LOGIT_BIAS_ENTRIES} entries, got {len(self.bias_pairs)}"
            )
        for token, _ in self.bias_pairs:
            if not isinstance(token, int) or isinstance(token, bool) or token < 0:
                raise SamplingParamsError(f"logit_bias: keys must be token ids >= 0, got {token!r}")
        object.__setattr__(self, "logit_bias", tuple(sorted(self.bias_pairs)))
        for token, bias in self.bias_pairs:
            if not isinstance(bias, int | float) or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise SamplingParamsError(
                    f"logit_bias: the bias of token {token} must be in "
                    f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {bias}"
                )

    @property
    def is_greedy(self) -> bool:
        """Temperature 0, or one too small to divide logits by: below ``MIN_TEMPERATURE``
        the scaled logits overflow fp32 to inf and the distribution to NaN, which once
        sampled an id past the vocabulary and failed a whole batch."""
        return self.temperature < MIN_TEMPERATURE

    @property
    def bias_pairs(self) -> LogitBias:
        """``logit_bias`` as (token id, bias) pairs, ids ascending."""
        return self.logit_bias  # type: ignore[return-value]  # normalised in __post_init__

    @property
    def uses_penalties(self) -> bool:
        """Some penalty or bias changes the logits: the sampler needs the row's tokens."""
        return bool(
            self.frequency_penalty
            or self.presence_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
        )

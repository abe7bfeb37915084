"""What the SDK returns: frozen dataclasses read from the wire's messages, so callers
never touch generated protobuf classes."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from tandem.v1 import generation_pb2 as gen

_FINISH_PREFIX = "FINISH_REASON_"


@dataclass(frozen=True)
class SpeculativeUsage:
    """What speculative decoding did for one request (the names of engine.spec.stats)."""

    num_drafts: int  # decode steps that verified at least one draft token
    num_draft_tokens: int  # draft tokens verified
    num_accepted_tokens: int  # of those, accepted
    num_steps_without_drafts: int = 0  # decode steps run with K = 0 (adaptive speculation)

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per verifying step: accepted drafts + 1 (1.0 when nothing was drafted)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0


@dataclass(frozen=True)
class Usage:
    """Token counts of a finished request."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens whose KV came from the prefix cache
    speculative: SpeculativeUsage | None  # None when the model runs without a draft

    @classmethod
    def from_proto(cls, usage: gen.Usage) -> Usage:
        """From the wire's ``Usage``."""
        spec = None
        if usage.HasField("speculative"):
            s = usage.speculative
            spec = SpeculativeUsage(
                s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens, s.num_steps_without_drafts
            )
        return cls(usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens, spec)


@dataclass(frozen=True)
class TopLogprob:
    """One alternative token and its log-probability."""

    token_id: int
    logprob: float


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability and the most likely alternatives."""

    token_id: int
    logprob: float
    top: tuple[TopLogprob, ...]  # most likely first; as many as the request's ``logprobs``

    @classmethod
    def from_proto(cls, entry: gen.TokenLogprob) -> TokenLogprob:
        """From the wire's ``TokenLogprob``."""
        top = tuple(TopLogprob(t.token_id, t.logprob) for t in entry.top)
        return cls(entry.token_id, entry.logprob, top)


@dataclass(frozen=True)
class Chunk:
    """A slice of a streamed completion: consecutive tokens starting at ``index``."""

    request_id: str
    index: int  # position in the completion of token_ids[0] (the first generated token is 0)
    token_ids: tuple[int, ...]
    text: str  # the text these tokens complete
    logprobs: tuple[TokenLogprob, ...]  # one per token when the request asked for logprobs
    finish_reason: str | None  # "stop", "length" or "abort" on the last chunk, else None
    stop_reason: int | str | None  # the stop token id or stop string ending a "stop"
    usage: Usage | None  # on the last chunk only
    # The first chunk, when asked: prompt tokens from the second on (the first has none).
    prompt_logprobs: tuple[TokenLogprob, ...] = ()

    @classmethod
    def from_proto(cls, chunk: gen.GenerateChunk) -> Chunk:
        """From the wire's ``GenerateChunk``."""
        finish = None
        if chunk.finish_reason != gen.FINISH_REASON_UNSPECIFIED:
            finish = gen.FinishReason.Name(chunk.finish_reason).removeprefix(_FINISH_PREFIX)
        which = chunk.WhichOneof("stop_reason")
        return cls(
            request_id=chunk.request_id,
            index=chunk.index,
            token_ids=tuple(chunk.token_ids),
            text=chunk.text,
            logprobs=tuple(TokenLogprob.from_proto(e) for e in chunk.logprobs),
            finish_reason=finish.lower() if finish else None,
            stop_reason=getattr(chunk, which) if which else None,
            usage=Usage.from_proto(chunk.usage) if chunk.HasField("usage") else None,
            prompt_logprobs=tuple(TokenLogprob.from_proto(e) for e in chunk.prompt_logprobs),
        )


@dataclass(frozen=True)
class Completion:
    """A whole answer: every chunk of a stream joined."""

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str  # "stop", "length" or "abort"
    stop_reason: int | str | None  # the stop token id or stop string ending a "stop"
    logprobs: tuple[TokenLogprob, ...] | None  # one per token; None unless asked for
    usage: Usage | None
    # Prompt tokens from the second on (the first has no logprob); None unless asked for.
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None

    @classmethod
    def join(
        cls, chunks: Iterable[Chunk], *, has_logprobs: bool, has_prompt_logprobs: bool = False
    ) -> Completion:
        """The completion made of ``chunks`` (in order, the last one carrying the finish)."""
        request_id, texts = "", []
        ids: list[int] = []
        logprobs: list[TokenLogprob] = []
        prompt_logprobs: list[TokenLogprob] = []
        last: Chunk | None = None
        for chunk in chunks:
            request_id = request_id or chunk.request_id
            texts.append(chunk.text)
            ids.extend(chunk.token_ids)
            logprobs.extend(chunk.logprobs)
            prompt_logprobs.extend(chunk.prompt_logprobs)
            last = chunk
        if last is None or last.finish_reason is None:
            raise ValueError("the stream ended without its last chunk")
        return cls(
            request_id=request_id,
            text="".join(texts),
            token_ids=tuple(ids),
            finish_reason=last.finish_reason,
            stop_reason=last.stop_reason,
            logprobs=tuple(logprobs) if has_logprobs else None,
            usage=last.usage,
            prompt_logprobs=tuple(prompt_logprobs) if has_prompt_logprobs else None,
        )


@dataclass(frozen=True)
class ModelInfo:
    """A served model, as ListModels describes it."""

    name: str  # what to pass as ``model=``
    max_model_len: int  # longest prompt + completion, in tokens
    draft_model: str  # "" without speculative decoding
    draft_kind: str  # "eagle", "eagle3", "dflash"; "" without a draft
    parent: str = ""  # a LoRA adapter's base model; "" for the served model itself

    @classmethod
    def from_proto(cls, info: gen.ModelInfo) -> ModelInfo:
        """From the wire's ``ModelInfo``."""
        return cls(info.name, info.max_model_len, info.draft_model, info.draft_kind, info.parent)

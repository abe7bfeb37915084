"""OpenAI bodies to GenerateRequests, and the router's chunks back to OpenAI's JSON.

One GenerateRequest per choice: a completion body with prompts ``p`` and ``n`` choices
makes ``len(p) * n`` of them, choice ``i * n + j`` being prompt ``i``'s ``j``-th (as
OpenAI numbers them). With a seed, choice ``j`` samples with ``seed + j``, so that the
choices differ and each is reproducible.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from router.http_api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
    invalid,
)
from tandem.v1 import generation_pb2 as gen
from tandem_client import wire

FINISH_REASONS = {
    gen.FINISH_REASON_STOP: "stop",
    gen.FINISH_REASON_LENGTH: "length",
    gen.FINISH_REASON_ABORT: "abort",
}
MAX_SEED = 2**63
MAX_UINT32 = 2**32 - 1
TOKEN_ID = re.compile(r"[0-9]{1,20}")


def sampling(body: SamplingFields, choice: int, max_tokens: int | None) -> gen.SamplingParams:
    """The body's sampling fields for one choice (range checks are the router's own)."""
    top_k = body.top_k or 0
    if top_k < -1:
        raise invalid("top_k", f"must be an integer >= 0, or -1 (disabled), got {top_k}")
    if any(t < 0 for t in body.stop_token_ids or ()):
        raise invalid("stop_token_ids", "token ids must be >= 0")
    params = gen.SamplingParams(
        top_k=max(top_k, 0),
        min_p=body.min_p or 0.0,
        stop=body.stops(),
        stop_token_ids=body.stop_token_ids or (),
        ignore_eos=body.ignore_eos,
    )
    if not body.speculative:
        params.speculative = False
    if max_tokens is not None:
        params.max_tokens = max_tokens
    if body.temperature is not None:
        params.temperature = body.temperature
    if body.top_p is not None:
        params.top_p = body.top_p
    if body.seed is not None:
        if body.seed >= MAX_SEED:
            raise invalid("seed", f"must be an integer in [0, 2**63), got {body.seed}")
        params.seed = (body.seed + choice) % MAX_SEED
    if body.frequency_penalty is not None:
        params.frequency_penalty = body.frequency_penalty
    if body.presence_penalty is not None:
        params.presence_penalty = body.presence_penalty
    if body.repetition_penalty is not None:
        params.repetition_penalty = body.repetition_penalty
    params.logit_bias.update(logit_bias(body.logit_bias or {}))
    constraint = structured_output(body)
    if constraint is not None:
        params.structured_output.CopyFrom(constraint)
    return params


def structured_output(body: SamplingFields) -> gen.StructuredOutput | None:
    """OpenAI's ``response_format`` (chat) or vLLM's ``guided_*`` extras, at most one."""
    found: list[tuple[str, gen.StructuredOutput]] = []
    response_format = getattr(body, "response_format", None)
    formats = ("text", "json_object", "json_schema")
    if response_format is not None and response_format.type not in formats:
        got = response_format.type
        raise invalid("response_format.type", f"must be one of {', '.join(formats)}, got {got!r}")
    if response_format is not None and response_format.type == "json_object":
        found.append(("response_format", gen.StructuredOutput(json_object=True)))
    elif response_format is not None and response_format.type == "json_schema":
        spec = response_format.json_schema
        if spec is None or spec.schema_ is None:
            raise invalid("response_format.json_schema.schema", "is required (a JSON schema)")
        schema = json.dumps(spec.schema_)
        found.append(("response_format", gen.StructuredOutput(json_schema=schema)))
    if body.guided_json is not None:
        guided = body.guided_json
        text = guided if isinstance(guided, str) else json.dumps(guided)
        found.append(("guided_json", gen.StructuredOutput(json_schema=text)))
    if body.guided_regex is not None:
        found.append(("guided_regex", gen.StructuredOutput(regex=body.guided_regex)))
    if body.guided_grammar is not None:
        found.append(("guided_grammar", gen.StructuredOutput(grammar=body.guided_grammar)))
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise invalid(found[1][0], f"set one constraint per request, got {names}")
    marker = body.thinking_end
    if marker is not None:
        if not found:
            raise invalid("thinking_end", "needs a constraint (response_format or guided_*)")
        if not marker:
            raise invalid("thinking_end", "is empty")
        if len(marker) > wire.MAX_THINKING_END:
            got = len(marker)
            raise invalid("thinking_end", f"at most {wire.MAX_THINKING_END} characters, got {got}")
        found[0][1].thinking_end = marker
    return found[0][1] if found else None


def logit_bias(bias: dict[str, float]) -> dict[int, float]:
    """OpenAI's logit_bias, whose keys are token ids written as strings, keyed by ids (the
    router checks the count, the values and the vocabulary)."""
    ids = {}
    for key, value in bias.items():
        if not TOKEN_ID.fullmatch(key):
            raise invalid("logit_bias", f"keys must be token ids (strings of digits), got {key!r}")
        token = int(key)
        if token > MAX_UINT32:
            raise invalid("logit_bias", f"token id {token} is outside the vocabulary")
        ids[token] = value
    return ids


def completion_requests(body: CompletionRequest, request_id: str) -> list[gen.GenerateRequest]:
    prompts: Sequence[str | list[int]]
    if isinstance(body.prompt, str):
        prompts = [body.prompt]
    elif body.prompt and all(isinstance(p, int) for p in body.prompt):
        prompts = [body.prompt]  # type: ignore[list-item]  # one prompt of token ids
    else:
        prompts = body.prompt  # type: ignore[assignment]  # strings, or lists of ids
    if not prompts:
        raise invalid("prompt", "no prompt")
    if any(isinstance(p, list) and any(t < 0 for t in p) for p in prompts):
        raise invalid("prompt", "token ids must be >= 0")
    requests = []
    for i, prompt in enumerate(prompts):
        for j in range(body.n):
            request = gen.GenerateRequest(
                request_id=f"{request_id}-{i * body.n + j}",
                model=body.model,
                sampling=sampling(body, j, body.max_tokens),
            )
            if isinstance(prompt, str):
                request.text = prompt
            else:
                request.token_ids.ids.extend(prompt)
            if body.logprobs is not None:
                request.sampling.logprobs = body.logprobs
            if body.echo and (body.logprobs is not None or body.max_tokens == 0):
                # max_tokens 0 is allowed with prompt logprobs only: ask for them then too.
                request.sampling.prompt_logprobs = body.logprobs or 0
            requests.append(request)
    return requests


@dataclass(frozen=True)
class Echo:
    """A completion choice's prompt, returned before its completion (``echo``)."""

    text: str
    first_token_id: int  # the prompt's first token: no logprob, null in the answer


def chat_requests(
    body: ChatCompletionRequest, request_id: str, prompt_ids: Sequence[int], max_model_len: int
) -> list[gen.GenerateRequest]:
    """``prompt_ids``: the conversation as the chat template renders it, tokenized; without
    a max_tokens, a choice may fill the rest of the context."""
    max_tokens = body.max_completion_tokens or body.max_tokens
    if max_tokens is None:
        max_tokens = max(1, max_model_len - len(prompt_ids))
    requests = []
    for j in range(body.n):
        request = gen.GenerateRequest(
            request_id=f"{request_id}-{j}", model=body.model, sampling=sampling(body, j, max_tokens)
        )
        request.token_ids.ids.extend(prompt_ids)
        if body.logprobs:
            request.sampling.logprobs = body.top_logprobs or 0
        elif body.top_logprobs:
            raise invalid("top_logprobs", "needs logprobs: true")
        requests.append(request)
    return requests


def chat_messages(body: ChatCompletionRequest) -> gen.GenerateRequest:
    """The conversation as the router's validator renders and tokenizes it."""
    request = gen.GenerateRequest()
    request.chat.messages.extend(
        gen.ChatMessage(role=m.role, content=m.text()) for m in body.messages
    )
    return request


@dataclass
class ChoiceState:
    """What one choice has produced so far."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[gen.TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    usage: gen.Usage | None = None
    echo: Echo | None = None  # the prompt goes first: in ``text`` from the start

    def __post_init__(self) -> None:
        if self.echo is not None:
            self.text = self.echo.text

    def add(self, chunk: gen.GenerateChunk) -> None:
        self.text += chunk.text
        self.token_ids.extend(chunk.token_ids)
        self.logprobs.extend(chunk.prompt_logprobs)  # the first chunk's: before the rest
        self.logprobs.extend(chunk.logprobs)
        if chunk.finish_reason != gen.FINISH_REASON_UNSPECIFIED:
            self.finish_reason = FINISH_REASONS.get(chunk.finish_reason, "abort")
        if chunk.HasField("usage"):
            self.usage = chunk.usage


def usage_json(choices: Sequence[ChoiceState], n: int) -> dict[str, Any]:
    """Prompt tokens once per prompt (not per choice), completion tokens of every choice."""
    prompt = sum(c.usage.prompt_tokens for c in choices[::n] if c.usage is not None)
    completion = sum(c.usage.completion_tokens for c in choices if c.usage is not None)
    cached = sum(c.usage.cached_tokens for c in choices[::n] if c.usage is not None)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


TokenText = Callable[[int], str]


def chat_logprobs(entries: Sequence[gen.TokenLogprob], token_text: TokenText) -> dict[str, Any]:
    def one(token_id: int, logprob: float) -> dict[str, Any]:
        text = token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {
        "content": [
            {
                **one(e.token_id, e.logprob),
                "top_logprobs": [one(t.token_id, t.logprob) for t in e.top],
            }
            for e in entries
        ]
    }


def completion_logprobs(
    entries: Sequence[gen.TokenLogprob],
    token_text: TokenText,
    text_offset: int,
    echo: Echo | None = None,
) -> dict[str, Any]:
    """OpenAI's completion logprobs; with ``echo`` (the first chunk of an echoed choice),
    the prompt's first token goes first with null logprob and alternatives, as OpenAI's."""
    tokens = [token_text(e.token_id) for e in entries]
    logprobs: list[float | None] = [e.logprob for e in entries]
    top: list[dict[str, float] | None] = [
        {token_text(t.token_id): t.logprob for t in e.top} for e in entries
    ]
    if echo is not None:
        tokens.insert(0, token_text(echo.first_token_id))
        logprobs.insert(0, None)
        top.insert(0, None)
    offsets = []
    for token in tokens:
        offsets.append(text_offset)
        text_offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": logprobs,
        "top_logprobs": top,
        "text_offset": offsets,
    }

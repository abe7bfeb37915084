"""Building a ``tandem.v1.GenerateRequest``: a prompt in one of its three forms and the
sampling parameters as keywords, checked against the wire contract before any call."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, TypedDict

import grpc  # type: ignore[import-untyped]  # no types-grpcio in the dev extra

from tandem.v1 import generation_pb2 as gen
from tandem_client.errors import InvalidRequest

# Text, token ids, or chat messages ({"role", "content"} dicts, oldest turn first).
Prompt = str | Sequence[int] | Sequence[Mapping[str, str]]

# The keywords the clients accept: every field of the wire's SamplingParams.
SAMPLING_FIELDS = frozenset(gen.SamplingParams.DESCRIPTOR.fields_by_name)


class SamplingKwargs(TypedDict, total=False):
    """``tandem.v1.SamplingParams``' fields as keywords (the proto documents each);
    tests/client/test_sdk.py keeps the two equal."""

    max_tokens: int  # >= 1 (0 with prompt_logprobs: score the prompt only); unset: 16
    temperature: float  # 0 is greedy; unset: 1.0
    top_k: int  # 0 disables
    top_p: float  # (0, 1]; unset: 1.0
    min_p: float  # 0 disables
    seed: int  # unset: a fresh seed per request
    stop: str | Sequence[str]  # stop strings (the matched one is not returned)
    stop_token_ids: Sequence[int]  # token ids that end generation (returned)
    ignore_eos: bool
    logprobs: int  # also return this many top alternatives per token (0..20)
    prompt_logprobs: int  # the prompt tokens' logprobs too, with this many alternatives (0..20)
    frequency_penalty: float  # [-2, 2]; minus this times a token's count in the output
    presence_penalty: float  # [-2, 2]; minus this for a token in the output
    repetition_penalty: float  # (0, 100]; seen tokens' logits divided (> 0) or multiplied
    logit_bias: Mapping[int, float]  # token id -> bias in [-100, 100], at most 300
    # What the output must match, one of {"json_object": True}, {"json_schema": a dict or
    # JSON text}, {"regex": ...}, {"grammar": GBNF with a root rule} (or the message)
    structured_output: Mapping[str, Any] | gen.StructuredOutput
    speculative: bool  # False: verify no drafts (what decoding without one samples)


def sampling_params(params: Mapping[str, Any]) -> gen.SamplingParams:
    """``params`` as a SamplingParams. TypeError for an unknown name or a wrong type,
    InvalidRequest for a value the wire cannot carry (a negative ``max_tokens``...)."""
    unknown = sorted(set(params) - SAMPLING_FIELDS)
    if unknown:
        raise TypeError(
            f"unknown sampling parameter {unknown[0]!r}; expected one of {sorted(SAMPLING_FIELDS)}"
        )
    message = gen.SamplingParams()
    for name, value in params.items():
        if value is None:  # unset: the server's default
            continue
        if name == "stop" and isinstance(value, str):
            value = [value]
        if name == "structured_output":
            message.structured_output.CopyFrom(structured_output(value))
            continue
        try:
            if isinstance(value, Mapping):  # a map field: logit_bias
                getattr(message, name).update(value)
            elif isinstance(value, str | bytes) or not isinstance(value, Sequence):
                setattr(message, name, value)
            else:
                getattr(message, name).extend(value)
        except TypeError as e:
            raise TypeError(f"{name}: {e}") from None
        except ValueError as e:
            raise InvalidRequest(grpc.StatusCode.INVALID_ARGUMENT, f"{name}: {e}") from None
    return message


def structured_output(value: Any) -> gen.StructuredOutput:
    """The ``structured_output`` keyword as its message: a dict of one constraint kind (a
    ``json_schema`` given as a dict is sent as JSON text), optionally with ``thinking_end``
    (the constraint applies after that marker), or the message itself."""
    if isinstance(value, gen.StructuredOutput):
        return value
    kinds = [f.name for f in gen.StructuredOutput.DESCRIPTOR.oneofs_by_name["kind"].fields]
    options = dict(value) if isinstance(value, Mapping) else {}
    thinking_end = options.pop("thinking_end", "")
    if len(options) != 1:
        raise TypeError(
            f"structured_output: a dict of one of {sorted(kinds)} (and thinking_end), got {value!r}"
        )
    ((kind, spec),) = options.items()
    if kind == "json_schema" and not isinstance(spec, str):
        spec = json.dumps(spec)
    try:
        return gen.StructuredOutput(**{kind: spec}, thinking_end=thinking_end)
    except (TypeError, ValueError) as e:
        raise TypeError(f"structured_output: {e}; expected one of {sorted(kinds)}") from None


def build_request(
    prompt: Prompt, *, request_id: str | None = "", model: str = "", **params: Any
) -> gen.GenerateRequest:
    """A GenerateRequest: the prompt as text, token ids, or chat messages; keyword
    arguments are SamplingParams fields (max_tokens, temperature, stop, ...)."""
    request = gen.GenerateRequest(
        request_id=request_id or "", model=model, sampling=sampling_params(params)
    )
    if isinstance(prompt, str):
        request.text = prompt
    elif prompt and isinstance(prompt[0], Mapping):
        for m in prompt:
            if not isinstance(m, Mapping) or set(m) - {"role", "content"}:
                raise TypeError(f"chat: each message is a {{'role', 'content'}} dict, got {m!r}")
            request.chat.messages.add(role=m.get("role", ""), content=m.get("content", ""))
    else:
        request.token_ids.SetInParent()  # the prompt's form is token ids, even when empty
        try:
            request.token_ids.ids.extend(int(t) for t in prompt)  # type: ignore[arg-type]
        except ValueError as e:
            raise InvalidRequest(grpc.StatusCode.INVALID_ARGUMENT, f"token_ids: {e}") from None
    return request

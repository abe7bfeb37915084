"""A GenerateRequest checked and tokenized: every refusal is a ValueError whose message
starts with the field at fault (the interceptor answers INVALID_ARGUMENT with it)."""

from __future__ import annotations

import json
import re
import secrets
import uuid
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from engine.sampling_params import MAX_STOP_SEQUENCES, SamplingParams
from serving.sampling import params_from_proto
from tandem.v1 import generation_pb2 as gen

REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
MAX_CHAT_MESSAGES = 1024


class ValidationError(ValueError):
    """A request the router refuses; the message names the field."""


@dataclass(frozen=True)
class ModelInfo:
    """What the router knows of the served model (read from config.json; no torch)."""

    name: str
    vocab_size: int
    max_model_len: int

    @classmethod
    def from_dir(cls, model_dir: Path, name: str, max_model_len: int | None = None) -> ModelInfo:
        config = json.loads((model_dir / "config.json").read_text())
        limit = int(config["max_position_embeddings"])
        if max_model_len is not None:
            if not 0 < max_model_len <= limit:
                raise ValueError(f"max_model_len: {max_model_len} is outside 1..{limit}")
            limit = max_model_len
        return cls(name=name, vocab_size=int(config["vocab_size"]), max_model_len=limit)


@dataclass(frozen=True)
class ValidRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams  # seed always set: prefill and decode sample the same stream
    sampling: gen.SamplingParams  # the same, as sent to the workers


class RequestValidator:
    def __init__(
        self, model: ModelInfo, tokenizer: Any | None, *, max_request_bytes: int = 1 << 20
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.max_request_bytes = max_request_bytes

    def validate(self, request: gen.GenerateRequest) -> ValidRequest:
        size = request.ByteSize()
        prompt_field = request.WhichOneof("prompt")
        if size > self.max_request_bytes:
            raise ValidationError(
                f"{prompt_field or 'request'}: the request is {size} bytes, over the limit of "
                f"{self.max_request_bytes}"
            )
        request_id = request.request_id or f"r-{uuid.uuid4().hex}"
        if not REQUEST_ID.fullmatch(request_id):
            raise ValidationError(
                f"request_id: 1..128 characters of [A-Za-z0-9._:-], got {request_id[:140]!r}"
            )
        if request.model and request.model != self.model.name:
            raise ValidationError(
                f"model: unknown model {request.model[:200]!r}; served: [{self.model.name!r}]"
            )
        if len(request.sampling.stop) > MAX_STOP_SEQUENCES:
            raise ValidationError(
                f"stop: at most {MAX_STOP_SEQUENCES} stop strings, got {len(request.sampling.stop)}"
            )
        params = params_from_proto(request.sampling)  # SamplingParamsError names the field
        if params.stop and self.tokenizer is None:
            raise ValidationError("stop: stop strings need a tokenizer; use stop_token_ids")
        vocab = self.model.vocab_size
        bad = [t for t in params.stop_token_ids if t >= vocab]
        if bad:
            raise ValidationError(
                f"stop_token_ids: token id {bad[0]} is outside the vocabulary [0, {vocab})"
            )
        prompt = self._prompt(request, prompt_field)
        total = len(prompt) + params.max_tokens
        if total > self.model.max_model_len:
            raise ValidationError(
                f"max_tokens: prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) = "
                f"{total} exceeds the context length {self.model.max_model_len}"
            )
        if params.seed is None:
            params = replace(params, seed=secrets.randbits(63))
        sampling = gen.SamplingParams()
        sampling.CopyFrom(request.sampling)
        sampling.seed = params.seed  # type: ignore[assignment]
        return ValidRequest(request_id, prompt, params, sampling)

    def _prompt(self, request: gen.GenerateRequest, field: str | None) -> list[int]:
        if field is None:
            raise ValidationError("prompt: set one of text, token_ids or chat")
        if field == "token_ids":
            ids = list(request.token_ids.ids)
        elif field == "text":
            ids = self._encode("text", request.text, add_special_tokens=True)
        else:
            ids = self._encode("chat", self._render_chat(request.chat), add_special_tokens=False)
        if not ids:
            raise ValidationError(f"{field}: the prompt is empty; send at least one token")
        vocab = self.model.vocab_size
        bad = [t for t in ids if t >= vocab]
        if bad:
            raise ValidationError(
                f"{field}: token id {bad[0]} is outside the vocabulary [0, {vocab})"
            )
        return ids

    def _encode(self, field: str, text: str, *, add_special_tokens: bool) -> list[int]:
        if self.tokenizer is None:
            raise ValidationError(
                f"{field}: model {self.model.name!r} has no tokenizer; send token_ids"
            )
        max_chars = 64 * self.model.max_model_len  # far beyond any token's length
        if len(text) > max_chars:
            raise ValidationError(f"{field}: {len(text)} characters, over the limit of {max_chars}")
        ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return [int(t) for t in ids]

    def _render_chat(self, chat: gen.ChatMessages) -> str:
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValidationError(f"chat: model {self.model.name!r} has no chat template")
        if not chat.messages:
            raise ValidationError("chat: no messages")
        if len(chat.messages) > MAX_CHAT_MESSAGES:
            raise ValidationError(f"chat: {len(chat.messages)} messages, over {MAX_CHAT_MESSAGES}")
        messages = []
        for i, m in enumerate(chat.messages):
            if not m.role:
                raise ValidationError(f"chat: messages[{i}].role is empty")
            messages.append({"role": m.role, "content": m.content})
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
        except Exception as e:  # the template rejects the conversation (jinja raise)
            raise ValidationError(f"chat: the chat template refused it: {e}") from e
        return str(text)

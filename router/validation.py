"""A GenerateRequest checked and tokenized: every refusal is a ValueError whose message
starts with the field at fault (the interceptor answers INVALID_ARGUMENT with it; the
HTTP API answers an unknown model, ``UnknownModel``, with 404)."""

from __future__ import annotations

import json
import re
import secrets
import uuid
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path

from router.tokenizer import RouterTokenizer
from tandem.v1 import generation_pb2 as gen
from tandem_client import wire

REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
MAX_CHAT_MESSAGES = 1024


class ValidationError(ValueError):
    """A request the router refuses; the message names the field."""


class UnknownModel(ValidationError):
    """A model field that names neither the served model nor one of its adapters."""


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
    sampling: gen.SamplingParams  # as sent to the workers; seed always set: P and D sample alike
    max_tokens: int  # the request's, or the wire's default when unset
    lora: str = ""  # the LoRA adapter its model field named; "": the base model


def check_sampling(message: gen.SamplingParams) -> None:
    """Refuses what the engine's SamplingParams refuses, with its messages, in its order
    (the stop count first: a long list is refused before it is walked)."""
    if len(message.stop) > wire.MAX_STOP_SEQUENCES:
        raise ValidationError(
            f"stop: at most {wire.MAX_STOP_SEQUENCES} stop strings, got {len(message.stop)}"
        )
    min_tokens = 0 if message.HasField("prompt_logprobs") else wire.MIN_MAX_TOKENS
    if message.HasField("max_tokens") and message.max_tokens < min_tokens:
        raise ValidationError(
            f"max_tokens: must be an integer >= {min_tokens}, got {message.max_tokens!r}"
        )
    if message.HasField("temperature") and not 0.0 <= message.temperature <= wire.MAX_TEMPERATURE:
        raise ValidationError(
            f"temperature: must be in [0, {wire.MAX_TEMPERATURE:g}], got {message.temperature}"
        )
    if message.top_k < 0:
        raise ValidationError(f"top_k: must be an integer >= 0 (0 disables), got {message.top_k!r}")
    if message.HasField("top_p") and not 0.0 < message.top_p <= 1.0:
        raise ValidationError(f"top_p: must be in (0, 1], got {message.top_p}")
    if not 0.0 <= message.min_p <= 1.0:
        raise ValidationError(f"min_p: must be in [0, 1], got {message.min_p}")
    if message.HasField("seed") and not 0 <= message.seed < wire.MAX_SEED:
        raise ValidationError(f"seed: must be an integer in [0, 2**63), got {message.seed!r}")
    if any(not s for s in message.stop):
        raise ValidationError("stop: every stop string must be a non-empty string")
    if any(t < 0 for t in message.stop_token_ids):
        raise ValidationError(
            f"stop_token_ids: must be token ids >= 0, got {tuple(message.stop_token_ids)}"
        )
    if message.HasField("logprobs") and not 0 <= message.logprobs <= wire.MAX_LOGPROBS:
        raise ValidationError(
            f"logprobs: must be in [0, {wire.MAX_LOGPROBS}], got {message.logprobs}"
        )
    if message.HasField("prompt_logprobs") and not (
        0 <= message.prompt_logprobs <= wire.MAX_PROMPT_LOGPROBS
    ):
        raise ValidationError(
            f"prompt_logprobs: must be in [0, {wire.MAX_PROMPT_LOGPROBS}], "
            f"got {message.prompt_logprobs}"
        )
    for name in ("frequency_penalty", "presence_penalty"):
        value = getattr(message, name)
        if not -wire.MAX_FREQUENCY_PENALTY <= value <= wire.MAX_FREQUENCY_PENALTY:
            raise ValidationError(
                f"{name}: must be in [-{wire.MAX_FREQUENCY_PENALTY:g}, "
                f"{wire.MAX_FREQUENCY_PENALTY:g}], got {value}"
            )
    if message.HasField("repetition_penalty") and not (
        0.0 < message.repetition_penalty <= wire.MAX_REPETITION_PENALTY
    ):
        raise ValidationError(
            f"repetition_penalty: must be in (0, {wire.MAX_REPETITION_PENALTY:g}] (1 is off), "
            f"got {message.repetition_penalty}"
        )
    if len(message.logit_bias) > wire.MAX_LOGIT_BIAS_ENTRIES:
        raise ValidationError(
            f"logit_bias: at most {wire.MAX_LOGIT_BIAS_ENTRIES} entries, "
            f"got {len(message.logit_bias)}"
        )
    for token, bias in sorted(message.logit_bias.items()):
        if not -wire.MAX_LOGIT_BIAS <= bias <= wire.MAX_LOGIT_BIAS:
            raise ValidationError(
                f"logit_bias: the bias of token {token} must be in "
                f"[-{wire.MAX_LOGIT_BIAS:g}, {wire.MAX_LOGIT_BIAS:g}], got {bias}"
            )
    if message.HasField("structured_output"):
        check_structured_output(message.structured_output)


def check_structured_output(constraint: gen.StructuredOutput) -> None:
    """What can be checked without compiling (the worker compiles, and refuses what does
    not compile with the same kind of message): one kind set, a schema that is a JSON object,
    a thinking_end marker within its length."""
    kind = constraint.WhichOneof("kind")
    if kind is None:
        raise ValidationError(
            "structured_output: set one of json_object, json_schema, regex, grammar"
        )
    if len(constraint.thinking_end) > wire.MAX_THINKING_END:
        raise ValidationError(
            f"structured_output.thinking_end: at most {wire.MAX_THINKING_END} characters, "
            f"got {len(constraint.thinking_end)}"
        )
    if kind == "json_object":
        return
    value = getattr(constraint, kind)
    if not value:
        raise ValidationError(f"structured_output.{kind}: is empty")
    if kind == "json_schema":
        try:
            schema = json.loads(value)
        except ValueError as e:
            raise ValidationError(
                f"structured_output.json_schema: is not valid JSON ({e})"
            ) from None
        if not isinstance(schema, (dict, bool)):
            raise ValidationError("structured_output.json_schema: must be a JSON object")


class RequestValidator:
    def __init__(
        self,
        model: ModelInfo,
        tokenizer: RouterTokenizer | None,
        *,
        max_request_bytes: int = 1 << 20,
        adapters: Callable[[], Collection[str]] = tuple,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.max_request_bytes = max_request_bytes
        # The LoRA adapters workers serve now (WorkerPicker.lora_names): a request's model
        # field may name one.
        self.adapters = adapters

    def lora_of(self, model: str) -> str:
        """The adapter a request's ``model`` field names ("": the base model, also when
        it is empty); UnknownModel (naming it and what is served) for anything else."""
        if not model or model == self.model.name:
            return ""
        adapters = self.adapters()
        if model in adapters:
            return model
        raise UnknownModel(
            f"model: unknown model {model[:200]!r}; served: "
            f"{[self.model.name, *sorted(adapters)]!r}"
        )

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
        lora = self.lora_of(request.model)
        check_sampling(request.sampling)
        if request.sampling.stop and self.tokenizer is None:
            raise ValidationError("stop: stop strings need a tokenizer; use stop_token_ids")
        vocab = self.model.vocab_size
        bad = [t for t in request.sampling.stop_token_ids if t >= vocab]
        if bad:
            raise ValidationError(
                f"stop_token_ids: token id {bad[0]} is outside the vocabulary [0, {vocab})"
            )
        bad = sorted(t for t in request.sampling.logit_bias if t >= vocab)
        if bad:
            raise ValidationError(
                f"logit_bias: token id {bad[0]} is outside the vocabulary [0, {vocab})"
            )
        prompt = self._prompt(request, prompt_field)
        max_tokens = (
            request.sampling.max_tokens
            if request.sampling.HasField("max_tokens")
            else wire.DEFAULT_MAX_TOKENS
        )
        total = len(prompt) + max_tokens
        if total > self.model.max_model_len:
            raise ValidationError(
                f"max_tokens: prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) = "
                f"{total} exceeds the context length {self.model.max_model_len}"
            )
        sampling = gen.SamplingParams()
        sampling.CopyFrom(request.sampling)
        if not sampling.HasField("seed"):
            sampling.seed = secrets.randbits(63)
        return ValidRequest(request_id, prompt, sampling, max_tokens, lora)

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

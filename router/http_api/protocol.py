"""The OpenAI request bodies the router accepts, as pydantic models, and their errors.

Fields follow OpenAI's API reference; the extras vLLM accepts at the top level of a body
(``top_k``, ``min_p``, ``ignore_eos``, ``stop_token_ids``, ``repetition_penalty``) are
accepted the same way (the ``openai`` client sends them with ``extra_body``), and so is
Tandem's own ``speculative`` (false: the request verifies no drafts). Types are
strict: a string where a number belongs is refused, not converted. Fields other clients
send and that change nothing here (``user``, ``metadata``, ``store``, ...) are ignored;
fields that would change the answer and are not supported yet get a 400 naming them.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_N = 8  # choices per request (n)
UINT32_MAX = 2**32 - 1  # what the wire's integer fields carry


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class HttpError(Exception):
    """An error answered as OpenAI-shaped JSON: ``{"error": {message, type, param, code}}``."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.retry_after_s: float | None = None  # a 429's hint from the server, if any

    @property
    def type(self) -> str:
        return {
            400: "invalid_request_error",
            401: "authentication_error",
            404: "not_found_error",
            405: "invalid_request_error",
            409: "invalid_request_error",
            413: "invalid_request_error",
            429: "rate_limit_error",
            503: "service_unavailable",
            504: "timeout",
        }.get(self.status, "server_error")

    def body(self) -> dict[str, Any]:
        error = ErrorBody(message=self.message, type=self.type, param=self.param, code=self.code)
        return {"error": error.model_dump()}


def invalid(param: str, message: str) -> HttpError:
    return HttpError(400, f"{param}: {message}", param=param, code="invalid_value")


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)

    include_usage: bool = False


class SamplingFields(BaseModel):
    """What completions and chat share: sampling, stops, streaming, and the extras."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: str
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # token id (a string of digits) -> bias
    user: str | None = None
    # vLLM's extras
    top_k: int | None = Field(None, le=UINT32_MAX)
    min_p: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    # Tandem's: false, this request verifies no drafts (what decoding without one samples)
    speculative: bool = True
    repetition_penalty: float | None = None
    # vLLM's structured-output extras (at most one constraint per request)
    guided_json: str | dict[str, Any] | None = None  # a JSON schema
    guided_regex: str | None = None
    guided_grammar: str | None = None  # EBNF, GBNF style, root rule ``root``
    # A reasoning model's end-of-thinking marker: the constraint applies after it.
    thinking_end: str | None = None

    def unsupported(self) -> list[str]:
        """Fields set to a value that would change the answer, which is not built yet."""
        return []

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or ())


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(
        16, ge=0, le=UINT32_MAX
    )  # 0 only with echo (the router refuses it else)
    logprobs: int | None = Field(None, ge=0, le=UINT32_MAX)
    echo: bool = False  # the prompt before the completion, in text and logprobs
    suffix: str | None = None
    best_of: int | None = None

    def unsupported(self) -> list[str]:
        names = super().unsupported()
        if self.suffix is not None:
            names.append("suffix")
        if self.best_of is not None and self.best_of != self.n:
            names.append("best_of")
        return names


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True)

    type: Literal["text"]
    text: str


class ChatMessageIn(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    role: str = Field(min_length=1)
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: "text", "json_object" or "json_schema"."""

    model_config = ConfigDict(extra="allow")

    type: str
    json_schema: JsonSchemaFormat | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessageIn] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=UINT32_MAX)
    max_completion_tokens: int | None = Field(None, ge=1, le=UINT32_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=UINT32_MAX)
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: ResponseFormat | None = None

    def unsupported(self) -> list[str]:
        names = super().unsupported()
        if self.tools:
            names.append("tools")
        if self.tool_choice not in (None, "none"):
            names.append("tool_choice")
        return names

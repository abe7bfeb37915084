"""The servers a load test measures, behind one interface: ``check`` before the load (one
clear line if the server is not there), then ``send`` per request, which records each
chunk's arrival time and token count in a ``RequestRecord`` as it comes."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any, Literal, Protocol

from loadtest.data import RequestSpec
from loadtest.metrics import RequestRecord
from loadtest.speculative import SpecCounts
from tandem_client import AsyncTandemClient, TandemError
from tandem_client.exit_codes import ExitCode, exit_code


class TargetUnavailable(Exception):
    """The server did not answer its health or models check: no load is sent. ``code``:
    the `tandem` command's exit code for it (3, or 7 for refused credentials)."""

    def __init__(self, message: str, code: ExitCode = ExitCode.UNAVAILABLE) -> None:
        super().__init__(message)
        self.code = code


class Target(Protocol):
    """A server under load."""

    name: str  # "tandem" or "openai"
    model: str  # the model asked for ("" for the router's default)

    async def check(self) -> None:
        """TargetUnavailable unless the server answers and serves ``model``."""

    async def send(self, spec: RequestSpec, record: RequestRecord, *, ignore_eos: bool) -> None:
        """Send one streaming request; append (arrival, num_tokens) per chunk to
        ``record.chunks`` as they come, then set ``record.end``, or ``record.error`` to
        the status code of a failure (never raises for a failed request)."""

    async def close(self) -> None: ...


class TandemTarget:
    """A Tandem router over gRPC, through the SDK's ``AsyncTandemClient.stream``: each
    chunk's token count is exact (several under speculative decoding)."""

    name = "tandem"

    def __init__(
        self, address: str, *, model: str = "", timeout_s: float, token: str | None
    ) -> None:
        self.address = address
        self.model = model
        # No retries: a load test counts a refused request, it does not hide it.
        self._client = AsyncTandemClient(address, timeout=timeout_s, max_retries=0, token=token)

    async def check(self) -> None:
        try:
            status = await self._client.health(timeout=10)
            models = [m.name for m in await self._client.models(timeout=10)]
        except TandemError as e:
            code = exit_code(e)
            raise TargetUnavailable(
                f"the router at {self.address} did not answer ({e.code.name}: {e.message})",
                code if code == ExitCode.UNAUTHENTICATED else ExitCode.UNAVAILABLE,
            ) from None
        if status != "SERVING":
            raise TargetUnavailable(
                f"the router at {self.address} is {status}, not SERVING: its workers are "
                "still starting (or were lost); `tandem health --wait SECONDS` waits for them"
            )
        if self.model and self.model not in models:
            raise TargetUnavailable(
                f"the router at {self.address} serves {models}, not {self.model!r}",
                ExitCode.INVALID_REQUEST,
            )
        self.model = self.model or (models[0] if models else "")  # its default comes first

    async def send(self, spec: RequestSpec, record: RequestRecord, *, ignore_eos: bool) -> None:
        try:
            stream = self._client.stream(
                spec.prompt,
                model=self.model,
                max_tokens=spec.output_len,
                temperature=0.0,
                ignore_eos=ignore_eos,
            )
            async for chunk in stream:
                if chunk.token_ids:
                    record.chunks.append((time.perf_counter(), len(chunk.token_ids)))
                if chunk.usage is not None:
                    record.prompt_tokens = chunk.usage.prompt_tokens
                    if (spec_usage := chunk.usage.speculative) is not None:
                        record.speculative = SpecCounts(
                            spec_usage.num_drafts,
                            spec_usage.num_draft_tokens,
                            spec_usage.num_accepted_tokens,
                        )
            record.end = time.perf_counter()
        except TandemError as e:
            record.error = e.code.name

    async def close(self) -> None:
        await self._client.close()


class OpenAITarget:
    """Any OpenAI-compatible server, through the ``openai`` package's AsyncOpenAI: chat or
    completions, streaming, with usage asked for (``stream_options``) and ``ignore_eos`` in
    the body when asked. An HTTP event does not say how many tokens it carries: where the
    usage's completion tokens differ from the number of events with text, they are shared
    evenly among those events."""

    name = "openai"

    def __init__(
        self,
        base_url: str,
        *,
        model: str,
        endpoint: Literal["chat", "completions"],
        timeout_s: float,
        api_key: str | None,
    ) -> None:
        import openai  # the loadtest extra's; imported here so that --help needs no openai

        self.base_url = base_url
        self.model = model
        self.endpoint = endpoint
        self._openai = openai
        self._client = openai.AsyncOpenAI(
            base_url=base_url, api_key=api_key or "none", timeout=timeout_s, max_retries=0
        )

    async def check(self) -> None:
        try:
            models = [m.id async for m in self._client.models.list()]
        except (self._openai.AuthenticationError, self._openai.PermissionDeniedError) as e:
            raise TargetUnavailable(
                f"{self.base_url}/models refused the credentials ({e}); pass --api-key",
                ExitCode.UNAUTHENTICATED,
            ) from None
        except self._openai.OpenAIError as e:
            raise TargetUnavailable(f"{self.base_url}/models did not answer ({e})") from None
        if not self.model:
            if not models:
                raise TargetUnavailable(f"{self.base_url} serves no model")
            self.model = models[0]
        elif self.model not in models:
            raise TargetUnavailable(
                f"{self.base_url} serves {models}, not {self.model!r}", ExitCode.INVALID_REQUEST
            )

    async def send(self, spec: RequestSpec, record: RequestRecord, *, ignore_eos: bool) -> None:
        extra_body = {"ignore_eos": True} if ignore_eos else None
        common: dict[str, Any] = dict(
            model=self.model,
            max_tokens=spec.output_len,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=extra_body,
        )
        num_tokens: int | None = None
        try:
            if self.endpoint == "chat":
                messages: Any = _as_messages(spec.prompt)  # openai's TypedDicts
                stream: Any = await self._client.chat.completions.create(
                    messages=messages, **common
                )
            else:
                stream = await self._client.completions.create(
                    prompt=_as_text(spec.prompt), **common
                )
            async for event in stream:
                now = time.perf_counter()
                if event.usage is not None:
                    num_tokens = event.usage.completion_tokens
                    record.prompt_tokens = event.usage.prompt_tokens
                if event.choices and _carries_tokens(event.choices[0]):
                    record.chunks.append((now, 1))
            record.end = time.perf_counter()
        except self._openai.APIStatusError as e:
            record.error = str(e.status_code)
        except self._openai.APITimeoutError:
            record.error = "timeout"
        except self._openai.APIConnectionError:
            record.error = "connection"
        except self._openai.OpenAIError as e:  # a malformed answer...
            record.error = type(e).__name__
        if record.end is not None and num_tokens is not None:
            record.chunks = share_tokens(record.chunks, num_tokens)

    async def close(self) -> None:
        await self._client.close()


def share_tokens(chunks: Sequence[tuple[float, int]], num_tokens: int) -> list[tuple[float, int]]:
    """``num_tokens`` shared evenly among ``chunks`` (the later ones take the remainder),
    their times kept; as they are when there are none."""
    if not chunks:
        return list(chunks)
    base, extra = divmod(num_tokens, len(chunks))
    first_extra = len(chunks) - extra
    return [(t, base + (i >= first_extra)) for i, (t, _) in enumerate(chunks)]


def _carries_tokens(choice: Any) -> bool:
    """Whether a streamed choice carries generated tokens: text, or none yet (a token that
    decodes to nothing); not an empty last event (the finish reason alone) nor OpenAI's
    first chat event (the role alone)."""
    if _text_of(choice):
        return True
    if getattr(choice, "finish_reason", None) is not None:
        return False
    delta = getattr(choice, "delta", None)
    return not (delta is not None and getattr(delta, "role", None))


def _text_of(choice: Any) -> str:
    delta = getattr(choice, "delta", None)
    if delta is not None:
        return str(delta.content or "")
    return str(getattr(choice, "text", "") or "")


def _as_messages(prompt: Any) -> list[dict[str, str]]:
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if prompt and isinstance(prompt[0], Mapping):
        return [dict(m) for m in prompt]
    raise ValueError("an HTTP chat needs text or messages, not token ids")


def _as_text(prompt: Any) -> str:
    if isinstance(prompt, str):
        return prompt
    if prompt and isinstance(prompt[0], Mapping):
        return "\n".join(str(m.get("content", "")) for m in prompt)
    raise ValueError("an HTTP completion needs text, not token ids")

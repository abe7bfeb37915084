"""The OpenAI-compatible HTTP API of the router (FastAPI), beside its gRPC service.

Every request runs through the same ``GenerationService.Generate`` as a gRPC call, one
call per choice, so validation, routing, migration and usage are the gRPC API's.

- ``POST /v1/completions`` and ``POST /v1/chat/completions``: whole answers, or server-sent
  events ending in ``data: [DONE]`` (``stream``; ``stream_options.include_usage`` adds a
  last event with usage and no choices). Chat prompts are rendered by the router's chat
  template; a chat without ``max_tokens`` may fill the rest of the context.
- ``GET /v1/models``: the served name (the ``model`` a request names), and the LoRA adapters
  the workers serve, each with its ``parent`` (the served name): a request that names one
  runs under it.
- ``GET /health``: 200 when a warm worker pair serves the model, 503 before (starting), when
  they are lost, and while draining.

With a token (the router's ``--auth-token-file``), /v1/* requires ``Authorization: Bearer
TOKEN`` (401 ``authentication_error`` otherwise, before the body is read); /health is open.

Errors are OpenAI-shaped: ``{"error": {"message", "type", "param", "code"}}`` with 400 for
bad input (the field named in ``param`` and at the start of the message), 404 for an
unknown model, 429 when overloaded, 503 when no worker can take it or the router drains,
504 when its deadline passes. A client that disconnects cancels its request: for a stream
Starlette cancels the response, for a whole answer a watcher of the connection does, and
the workers free its blocks as for a cancelled gRPC call.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import redis
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from router.http_api.convert import (
    ChoiceState,
    Echo,
    chat_logprobs,
    chat_messages,
    chat_requests,
    completion_logprobs,
    completion_requests,
    usage_json,
)
from router.http_api.errors import BearerAuth, BodyLimit, body_error, error_response, http_error
from router.http_api.lora import add_lora_routes
from router.http_api.protocol import ChatCompletionRequest, CompletionRequest, HttpError
from router.service import GenerationService
from router.validation import UnknownModel
from serving.rpc import Unavailable
from tandem.v1 import generation_pb2 as gen

log = logging.getLogger("router.http")
T = TypeVar("T")

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
MAX_CALLS = 64  # choices of one HTTP request: prompts x n


class _CallContext:
    """What ``GenerationService.Generate`` reads of a gRPC context: no deadline of the
    client's, so the router's default applies."""

    def time_remaining(self) -> float | None:
        return None


def make_app(
    service: GenerationService,
    *,
    auth_token: str | None = None,
    allow_runtime_lora: bool = False,
) -> FastAPI:
    """The HTTP API over ``service`` (the router's Generation service); with
    ``auth_token``, /v1/* requires it as a bearer token; ``allow_runtime_lora`` adds the
    routes that load and unload LoRA adapters (router.http_api.lora)."""
    app = FastAPI(
        title="Tandem",
        summary="OpenAI-compatible completions and chat, served by a Tandem router",
        docs_url=None,
        redoc_url=None,
    )
    # The gRPC API's limit on a message (its prompt's bytes, x4 for the rest), for a body.
    app.add_middleware(BodyLimit, max_bytes=4 * service.validator.max_request_bytes)
    if auth_token is not None:  # added last, runs first: no body is read without the token
        app.add_middleware(BearerAuth, token=auth_token)
    api = _Api(service)

    @app.exception_handler(RequestValidationError)
    async def on_invalid_body(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(body_error(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def on_http_exception(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        """Starlette's own (an unknown path, a method not allowed, a body too large), in
        OpenAI's shape."""
        return error_response(HttpError(exc.status_code, str(exc.detail)))

    @app.exception_handler(HttpError)
    async def on_http_error(_: Request, exc: HttpError) -> JSONResponse:
        return error_response(exc)

    @app.get("/health")
    async def health() -> JSONResponse:
        if service.is_draining:
            return error_response(HttpError(503, "draining; use another router"))
        try:
            is_ready = service.is_ready()
        except redis.RedisError as e:
            return error_response(HttpError(503, f"the ledger's Redis is out of reach: {e}"))
        if not is_ready:
            return error_response(
                HttpError(
                    503,
                    "no warm prefill and decode worker for the model yet (starting, or lost); "
                    "requests sent now wait for them within their deadline",
                )
            )
        return JSONResponse({"status": "ok"})

    if allow_runtime_lora:
        add_lora_routes(app, service.lora_admin)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": api.model_cards()}

    @app.post("/v1/completions", response_model=None)
    async def completions(
        body: CompletionRequest, request: Request
    ) -> JSONResponse | StreamingResponse:
        api.check(body)
        rid = f"cmpl-{uuid.uuid4().hex}"
        calls = _converted(completion_requests, body, rid)
        echoes = api.echoes(calls) if body.echo else None
        return await api.respond(request, body, rid, calls, chat=False, echoes=echoes)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(
        body: ChatCompletionRequest, request: Request
    ) -> JSONResponse | StreamingResponse:
        api.check(body)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        try:
            prompt = service.validator.validate(chat_messages(body)).prompt_token_ids
        except Exception as e:
            raise http_error(e) from e
        max_len = service.validator.model.max_model_len
        calls = _converted(chat_requests, body, rid, prompt, max_len)
        return await api.respond(request, body, rid, calls, chat=True)

    return app


class _Api:
    """The routes' work: calls the service once per choice and shapes the answers."""

    def __init__(self, service: GenerationService) -> None:
        self.service = service
        self.created = int(time.time())

    @property
    def model_name(self) -> str:
        return self.service.validator.model.name

    def model_cards(self) -> list[dict[str, Any]]:
        """The served model, then each LoRA adapter the workers serve (``parent``: the
        model), as OpenAI's model objects."""
        card = {
            "object": "model",
            "created": self.created,
            "owned_by": "tandem",
            "max_model_len": self.service.validator.model.max_model_len,
        }
        adapters = self.service.picker.lora_names()
        return [
            {"id": self.model_name, **card, "root": self.model_name, "parent": None},
            *({"id": a, **card, "root": self.model_name, "parent": self.model_name}
              for a in adapters),
        ]  # fmt: skip

    def check(self, body: CompletionRequest | ChatCompletionRequest) -> None:
        try:
            self.service.validator.lora_of(body.model)
        except UnknownModel as e:
            raise HttpError(404, str(e), param="model", code="model_not_found") from None
        unsupported = body.unsupported()
        if unsupported:
            raise HttpError(
                400,
                f"{unsupported[0]}: not supported yet",
                param=unsupported[0],
                code="unsupported_parameter",
            )
        if self.service.is_draining:
            raise HttpError(503, "router: draining; retry on another router")

    def token_text(self, token_id: int) -> str:
        tokenizer = self.service.validator.tokenizer
        return tokenizer.decode([token_id]) if tokenizer is not None else ""

    def echoes(self, calls: list[gen.GenerateRequest]) -> list[Echo]:
        """Each call's prompt to echo; text prompts are sent as the ids they encode to."""
        echoes = []
        for call in calls:
            try:
                ids = self.service.validator.validate(call).prompt_token_ids
            except Exception as e:
                raise http_error(e) from e
            tokenizer = self.service.validator.tokenizer
            if call.WhichOneof("prompt") == "text":
                text = call.text
            else:
                text = tokenizer.decode(ids) if tokenizer is not None else ""
            call.token_ids.ids[:] = ids
            echoes.append(Echo(text, ids[0]))
        return echoes

    async def respond(
        self,
        request: Request,
        body: CompletionRequest | ChatCompletionRequest,
        rid: str,
        calls: list[gen.GenerateRequest],
        *,
        chat: bool,
        echoes: list[Echo] | None = None,
    ) -> JSONResponse | StreamingResponse:
        choices = [ChoiceState(echo=echoes[i] if echoes else None) for i in range(len(calls))]
        events = _merged([self.service.Generate(c, _CallContext()) for c in calls])
        if body.stream:
            try:  # the first chunk before the headers: a refusal is still an HTTP status
                first = await _unless_disconnected(request, _first(events))
            except Exception as e:
                await events.aclose()
                raise http_error(e) from e
            sse = self._sse(body, rid, choices, first, events, chat=chat)
            # Closed after the response, sent or not: a client gone mid-stream leaves no
            # generator suspended (Starlette cancels the sending, not the generators).
            closing = BackgroundTask(_close, sse, events)
            return StreamingResponse(
                sse, media_type="text/event-stream", headers=SSE_HEADERS, background=closing
            )

        async def collect() -> None:
            async for i, chunk in events:
                choices[i].add(chunk)

        try:
            await _unless_disconnected(request, collect())
        except Exception as e:
            raise http_error(e) from e
        return JSONResponse(self._whole(body, rid, choices, chat=chat))

    def _whole(
        self,
        body: CompletionRequest | ChatCompletionRequest,
        rid: str,
        choices: list[ChoiceState],
        *,
        chat: bool,
    ) -> dict[str, Any]:
        out = []
        for i, c in enumerate(choices):
            choice: dict[str, Any] = {"index": i, "finish_reason": c.finish_reason}
            if chat:
                choice["message"] = {"role": "assistant", "content": c.text}
                choice["logprobs"] = (
                    chat_logprobs(c.logprobs, self.token_text)
                    if isinstance(body, ChatCompletionRequest) and body.logprobs
                    else None
                )
            else:
                choice["text"] = c.text
                choice["logprobs"] = (
                    completion_logprobs(c.logprobs, self.token_text, 0, c.echo)
                    if isinstance(body, CompletionRequest) and body.logprobs is not None
                    else None
                )
            out.append(choice)
        return {
            "id": rid,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": body.model or self.model_name,
            "choices": out,
            "usage": usage_json(choices, body.n),
        }

    async def _sse(
        self,
        body: CompletionRequest | ChatCompletionRequest,
        rid: str,
        choices: list[ChoiceState],
        first: tuple[int, gen.GenerateChunk] | None,
        events: AsyncIterator[tuple[int, gen.GenerateChunk]],
        *,
        chat: bool,
    ) -> AsyncGenerator[str, None]:
        created = int(time.time())
        base = {
            "id": rid,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created,
            "model": body.model or self.model_name,
        }
        echoing = {i for i, c in enumerate(choices) if c.echo is not None}  # not yet echoed
        with_logprobs = (
            body.logprobs if isinstance(body, ChatCompletionRequest) else body.logprobs is not None
        )

        def event(i: int, chunk: gen.GenerateChunk) -> str:
            state = choices[i]
            offset = len(state.text)
            is_first = not state.token_ids and not state.text
            state.add(chunk)
            choice: dict[str, Any] = {"index": i, "finish_reason": state.finish_reason}
            if chat:
                delta: dict[str, Any] = {"content": chunk.text}
                if is_first:
                    delta["role"] = "assistant"
                choice["delta"] = delta
                choice["logprobs"] = (
                    chat_logprobs(chunk.logprobs, self.token_text) if with_logprobs else None
                )
            else:
                echo, entries = None, list(chunk.logprobs)
                if i in echoing:  # the first event: the prompt before the completion
                    echoing.discard(i)
                    echo, offset = state.echo, 0
                    entries = [*chunk.prompt_logprobs, *entries]
                choice["text"] = (echo.text if echo else "") + chunk.text
                choice["logprobs"] = (
                    completion_logprobs(entries, self.token_text, offset, echo)
                    if with_logprobs
                    else None
                )
            return _data({**base, "choices": [choice]})

        try:
            if first is not None:
                yield event(*first)
            async for i, chunk in events:
                yield event(i, chunk)
        except Exception as e:  # after the headers: the error travels as an event
            error = http_error(e)
            log.info("%s: stream ended by %s", rid, error.message)
            yield _data(error.body())
        else:
            if body.stream_options is not None and body.stream_options.include_usage:
                yield _data({**base, "choices": [], "usage": usage_json(choices, body.n)})
        yield "data: [DONE]\n\n"


def _data(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


async def _merged(
    streams: list[AsyncGenerator[gen.GenerateChunk, None]],
) -> AsyncGenerator[tuple[int, gen.GenerateChunk], None]:
    """The chunks of several streams as they come, each with its stream's index; the first
    failure ends it, and closing it cancels what still runs."""
    if len(streams) == 1:
        try:
            async for chunk in streams[0]:
                yield 0, chunk
        finally:
            await streams[0].aclose()
        return
    queue: asyncio.Queue[tuple[int, gen.GenerateChunk | None, BaseException | None]]
    queue = asyncio.Queue()

    async def pump(i: int, stream: AsyncGenerator[gen.GenerateChunk, None]) -> None:
        error: BaseException | None = None
        try:
            async for chunk in stream:
                queue.put_nowait((i, chunk, None))
        except BaseException as e:  # cancelled too: the reader must hear of it
            error = e
            raise
        finally:
            queue.put_nowait((i, None, error))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            i, item, error = await queue.get()
            if isinstance(error, asyncio.CancelledError):  # its call, not this reader
                raise Unavailable(f"choice {i}: its call was cancelled (the router stops?)")
            if error is not None:
                raise error
            if item is not None:
                yield i, item
            else:
                running -= 1
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """``work``'s result, unless the client disconnects first: then it is cancelled."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        raise HttpError(499, "the client disconnected")
    return task.result()


async def _disconnected(request: Request) -> None:
    """Returns when the client goes (the body is read already: nothing else comes)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _first(
    events: AsyncIterator[tuple[int, gen.GenerateChunk]],
) -> tuple[int, gen.GenerateChunk] | None:
    return await anext(events, None)


async def _close(*generators: AsyncGenerator[Any, None]) -> None:
    for generator in generators:
        await generator.aclose()


def _converted(
    convert: Callable[..., list[gen.GenerateRequest]], *args: Any
) -> list[gen.GenerateRequest]:
    """``convert``'s requests; a value the wire cannot carry (an integer past 2**32...)
    is a 400, and so are more calls than MAX_CALLS."""
    try:
        calls = convert(*args)
    except ValueError as e:  # protobuf: "Value out of range: ..."
        raise HttpError(
            400, f"request: a value is out of range ({e})", param="request", code="invalid_value"
        ) from e
    if len(calls) > MAX_CALLS:
        raise HttpError(
            400,
            f"prompt: {len(calls)} prompts x n; at most {MAX_CALLS} in one request",
            param="prompt",
            code="invalid_value",
        )
    return calls

"""The OpenAI-compatible HTTP API of the orchestrator (FastAPI), beside its gRPC GenerationService.

    POST /v1/completions        text or token-id prompts; SSE when "stream": true
    POST /v1/chat/completions   a chat through the target tokenizer's chat template (or --chat-template)
    GET  /v1/models             the one served model (--served-model-name, else the target's id)
    GET  /health                200 when the gRPC side is SERVING, else 503 (open, for probes)

Requests call the same Orchestrator object the gRPC servicer calls: same limits, admission, store
and exactness; a refusal has the status a gRPC client would get, mapped to HTTP (responses.HTTP_STATUS)
with an OpenAI error body. With tokens configured (the orchestrator's --auth-token-file) every route
but /health needs `Authorization: Bearer <token>` (what the `openai` package sends as its api_key);
the caller's identity (its token's digest) owns its requests as over gRPC.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Collection, Sequence
from dataclasses import replace
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse

from orchestrator.openai_http import responses
from orchestrator.openai_http.schemas import ChatCompletionRequest, CompletionRequest
from specdec.errors import NotFound, Unauthenticated
from specdec.generation import GenerationChunk, GenerationRequest, GenerationResult
from specdec.rpc.security import ANONYMOUS, UNAUTHENTICATED_MESSAGE, TokenAuthInterceptor, digest
from specdec.rpc.status import status_for

log = logging.getLogger(__name__)

FALLBACK_MODEL_NAME = "specdec"


class TokenLimit(Protocol):
    """The one setting the routes read of the orchestrator's config (a chat's default max_tokens)."""

    @property
    def max_new_tokens_limit(self) -> int: ...


class OpenAIBackend(Protocol):
    """What the HTTP routes call on the orchestrator (orchestrator.speculation.Orchestrator), so the
    door needs no more of it than this. An optional `target_info` (ModelInfo | None) names the
    served model and its context length once the verifier is met."""

    @property
    def config(self) -> TokenLimit: ...

    async def ensure_serving(self) -> None: ...

    async def generate(self, request: GenerationRequest, *, owner: str) -> GenerationResult: ...

    def generate_stream(self, request: GenerationRequest, *,
                        owner: str) -> AsyncIterator[GenerationChunk]: ...


class OpenAIFrontDoor:
    """What the routes need of the orchestrator: its generation calls, its serving state, its name."""

    def __init__(self, orchestrator: OpenAIBackend, *, served_model_name: str | None = None,
                 tokens: Collection[str] = ()) -> None:
        self.orchestrator = orchestrator
        self.served_model_name = served_model_name
        self._auth = TokenAuthInterceptor(tokens) if tokens else None
        self.created = int(time.time())

    @property
    def model_name(self) -> str:
        """--served-model-name, else the target's model id once the orchestrator has met its verifier."""
        if self.served_model_name:
            return self.served_model_name
        target = getattr(self.orchestrator, "target_info", None)
        return target.model_id if target is not None else FALLBACK_MODEL_NAME

    def owner(self, request: Request) -> str:
        """The caller's identity ("token:<digest>" or ANONYMOUS), checked against the tokens if any."""
        header = request.headers.get("authorization", "")
        token = header[7:].strip() if header[:7].lower() == "bearer " else None
        if self._auth is not None and not self._auth.accepts(token):
            raise Unauthenticated(UNAUTHENTICATED_MESSAGE)
        return f"token:{digest(token)}" if token else ANONYMOUS

    def check_model(self, model: str) -> None:
        if model != self.model_name:
            raise NotFound(f"model {model!r} does not exist; this server serves {self.model_name!r}")


def create_app(orchestrator: OpenAIBackend, *, served_model_name: str | None = None,
               tokens: Collection[str] = ()) -> FastAPI:
    """The ASGI app over `orchestrator` (orchestrator.speculation.Orchestrator or alike)."""
    door = OpenAIFrontDoor(orchestrator, served_model_name=served_model_name, tokens=tokens)
    app = FastAPI(title="specdec", summary="OpenAI-compatible API of a specdec orchestrator",
                  docs_url=None, redoc_url=None, openapi_url=None)
    app.state.door = door

    @app.exception_handler(RequestValidationError)
    async def _invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(part) for part in first.get("loc", ()) if part != "body" and not _type_tag(part))
        message = f"{where}: {first.get('msg', 'invalid value')}" if where else str(first.get("msg", exc))
        return _error_response(400, "invalid_request_error", message, param=where or None)

    @app.exception_handler(Exception)
    async def _any_error(request: Request, exc: Exception) -> JSONResponse:
        return error_response(exc)

    @app.get("/health")
    async def health() -> JSONResponse:
        try:
            await orchestrator.ensure_serving()
        except Exception as exc:  # noqa: BLE001 - not serving: the reason, as a gRPC client would read it
            return _error_response(503, "service_unavailable_error", status_for(exc)[1])
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        door.owner(request)
        target = getattr(orchestrator, "target_info", None)
        entry = {"id": door.model_name, "object": "model", "created": door.created, "owned_by": "specdec"}
        if target is not None and target.max_context:
            entry["max_model_len"] = target.max_context
        return JSONResponse({"object": "list", "data": [entry]})

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Any:
        owner = door.owner(request)
        door.check_model(body.model)
        samples = body.generation_requests()
        return await _respond(door, samples, owner, chat=False, prompts=len(body.prompts()),
                              stream=body.stream, include_usage=_include_usage(body))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        owner = door.owner(request)
        door.check_model(body.model)
        samples = body.generation_requests(orchestrator.config.max_new_tokens_limit)
        return await _respond(door, samples, owner, chat=True, prompts=1, stream=body.stream,
                              include_usage=_include_usage(body))

    return app


def _type_tag(part: Any) -> bool:
    """Whether a pydantic error location part names a union branch ("str", "list[int]"), not a field."""
    return isinstance(part, str) and ("[" in part or part in {"str", "int", "float", "bool", "list", "dict"})


def _include_usage(body: Any) -> bool:
    return bool(body.stream_options and body.stream_options.include_usage)


async def _respond(door: OpenAIFrontDoor, samples: list[GenerationRequest], owner: str, *, chat: bool,
                   prompts: int, stream: bool, include_usage: bool) -> Any:
    orchestrator = door.orchestrator
    await orchestrator.ensure_serving()  # UNAVAILABLE (503) before any work, as the gRPC gate does
    created, model = int(time.time()), door.model_name
    # One id for the response; its samples are stored as <id>-<i> (resumable over gRPC by that id).
    base = uuid.uuid4().hex
    samples = [replace(sample, request_id=f"{base}-{i}") for i, sample in enumerate(samples)]
    response_id = f"{'chatcmpl' if chat else 'cmpl'}-{base}"
    if not stream:
        results = await _all_results(orchestrator, samples, owner)
        body = (responses.chat_completion(response_id, created, model, results) if chat
                else responses.completion(response_id, created, model, results, prompts))
        return JSONResponse(body)
    chunks = merged_chunks([orchestrator.generate_stream(sample, owner=owner) for sample in samples])
    try:
        first = await anext(chunks)  # a refused request still gets its HTTP status, not a 200 stream
    except BaseException:
        await chunks.aclose()
        raise
    events = responses.StreamChunks(response_id, created, model, chat)
    return StreamingResponse(_events(events, first, chunks, len(samples), prompts, include_usage),
                             media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def _all_results(orchestrator: OpenAIBackend, samples: Sequence[GenerationRequest],
                       owner: str) -> list[GenerationResult]:
    """All samples at once (each takes its own request slot); the first error cancels the rest."""
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(orchestrator.generate(sample, owner=owner)) for sample in samples]
    except BaseExceptionGroup as errors:  # the samples' first error is the response's
        raise errors.exceptions[0] from None
    return [task.result() for task in tasks]


async def merged_chunks(streams: Sequence[AsyncIterator[GenerationChunk]],
                        ) -> AsyncGenerator[tuple[int, GenerationChunk], None]:
    """(choice index, chunk) as the streams produce them, one at a time; an error of any ends the
    merge with it, and every stream is closed however the merge ends."""
    queue: asyncio.Queue[tuple[int, GenerationChunk | None, BaseException | None]] = asyncio.Queue(
        maxsize=len(streams) * 4)

    async def pump(index: int, stream: AsyncIterator[GenerationChunk]) -> None:
        try:
            async with contextlib.aclosing(stream):  # type: ignore[type-var]
                async for chunk in stream:
                    await queue.put((index, chunk, None))
            await queue.put((index, None, None))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, which raises it
            await queue.put((index, None, exc))

    tasks = [asyncio.create_task(pump(i, stream)) for i, stream in enumerate(streams)]
    try:
        open_streams = len(streams)
        while open_streams:
            index, chunk, error = await queue.get()
            if error is not None:
                raise error
            if chunk is None:
                open_streams -= 1
                continue
            yield index, chunk
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _events(events: responses.StreamChunks, first: tuple[int, GenerationChunk],
                  chunks: AsyncIterator[tuple[int, GenerationChunk]], count: int, prompts: int,
                  include_usage: bool) -> AsyncIterator[str]:
    """The SSE body: a role chunk per chat choice, text chunks, a finish chunk per choice, the usage
    chunk when asked for, then [DONE]. An error after the first chunk becomes an error event (the
    status line is already sent), then [DONE]."""
    results: list[GenerationResult | None] = [None] * count
    try:
        if events.chat:
            for index in range(count):
                yield events.first(index)
        pending: tuple[int, GenerationChunk] | None = first
        while pending is not None:
            index, chunk = pending
            if chunk.text or chunk.result is None:
                yield events.text(index, chunk.text)
            if chunk.result is not None:
                results[index] = chunk.result
                yield events.text(index, "", chunk.result.finish_reason)
            pending = await anext(chunks, None)
        if include_usage:
            yield events.usage([r for r in results if r is not None], prompts)
    except Exception as exc:  # noqa: BLE001 - the client reads it as the stream's error
        status, error_type, message = http_error(exc)
        yield responses.sse(responses.error_body(message, error_type, code=str(status)))
    finally:
        await chunks.aclose()  # type: ignore[attr-defined]
    yield responses.DONE


def http_error(exc: BaseException) -> tuple[int, str, str]:
    """(HTTP status, OpenAI error type, message) of an exception, through its gRPC status."""
    code, message = status_for(exc)
    status, error_type = responses.HTTP_STATUS.get(code.name, (500, "internal_error"))
    if isinstance(exc, NotFound) and message.startswith("model "):
        return 404, "invalid_request_error", message
    return status, error_type, message


def error_response(exc: BaseException) -> JSONResponse:
    status, error_type, message = http_error(exc)
    if status == 500:
        log.error("HTTP request failed", exc_info=exc)
    code = "model_not_found" if status == 404 else ("invalid_api_key" if status == 401 else None)
    return _error_response(status, error_type, message, code=code)


def _error_response(status: int, error_type: str, message: str, *, code: str | None = None,
                    param: str | None = None) -> JSONResponse:
    return JSONResponse(responses.error_body(message, error_type, code=code, param=param), status_code=status)


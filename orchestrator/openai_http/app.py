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

Every refusal answers with OpenAI's error body, the field at fault in its `param`, from inside the
route (GuardedRoute), so none reaches Starlette's ServerErrorMiddleware: that one re-raises, and
uvicorn then logs a traceback and drops the keep-alive connection, for each bad request. The token
is checked before the body is read. Refusals are logged once each, rate-limited, without a
traceback unless the server is at fault (errors.RefusalLog).

A streamed response (SSE, EventStream) is closed at once when its client goes away: the response
closes its body whatever ends it, so the requests' runs end, their slots and engine sessions are
freed and their records stay resumable. A client that reads nothing has its runs closed after the
orchestrator's stream_idle_timeout_s (admission.paced) and its connection closed once a write has
waited admission.DOOR_GRACE_S longer. The
per-caller cap counts a request under the caller's identity, or its address when anonymous.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Collection, Coroutine, Sequence
from dataclasses import replace
from typing import Any, Protocol

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from orchestrator.admission import Caller, door_write_timeout
from orchestrator.openai_http import responses
from orchestrator.openai_http.connections import client_certificate, wait_until_read
from orchestrator.openai_http.errors import REFUSALS
from orchestrator.openai_http.schemas import ChatCompletionRequest, CompletionRequest, json_kind, param_of
from specdec.errors import NotFound, Unauthenticated
from specdec.generation import GenerationChunk, GenerationRequest, GenerationResult
from specdec.rpc.security import ANONYMOUS, UNAUTHENTICATED_MESSAGE, TokenAuthInterceptor, digest
from specdec.rpc.status import status_for
from specdec.rpc.tenants import Tenants

log = logging.getLogger(__name__)

FALLBACK_MODEL_NAME = "specdec"
OPEN_PATHS = frozenset({"/health"})  # answered without a token (probes)
CHAT_PATH = "/v1/chat/completions"


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

    async def generate(self, request: GenerationRequest, *, owner: str, caller: str) -> GenerationResult: ...

    def generate_stream(self, request: GenerationRequest, *, owner: str,
                        caller: str) -> AsyncIterator[GenerationChunk]: ...


class OpenAIFrontDoor:
    """What the routes need of the orchestrator: its generation calls, its serving state, its name."""

    def __init__(self, orchestrator: OpenAIBackend, *, served_model_name: str | None = None,
                 tokens: Collection[str] = (), tenants: Tenants | None = None) -> None:
        self.orchestrator = orchestrator
        self.tenants = tenants
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
        """The caller's identity, checked against the tokens if any: "token:<digest>", else
        "cert:<digest>" of its verified client certificate (mTLS), else ANONYMOUS; its tenant's
        (tenant:NAME) when the tenants name its token or its certificate's common name."""
        header = request.headers.get("authorization", "")
        token = header[7:].strip() if header[:7].lower() == "bearer " else None
        if self._auth is not None and not self._auth.accepts(token):
            raise Unauthenticated(UNAUTHENTICATED_MESSAGE)
        certificate = client_certificate(request.scope.get("client"))
        if token:
            owner = f"token:{digest(token)}"
        else:
            owner = f"cert:{digest(certificate.pem)}" if certificate is not None else ANONYMOUS
        if self.tenants is None:
            return owner
        return self.tenants.identity(owner, certificate.common_name if certificate is not None else None)

    def check_model(self, model: str) -> None:
        if model != self.model_name:
            raise NotFound(f"model {model!r} does not exist; this server serves {self.model_name!r}")


class GuardedRoute(APIRoute):
    """A route that checks the token before the body is read, and answers every error itself with
    an OpenAI error body, so that no exception leaves the app (see the module docstring)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        open_route = self.path in OPEN_PATHS

        async def guarded(request: Request) -> Response:
            try:
                if not open_route:
                    request.state.caller = Caller.of(request.app.state.door.owner(request), _address(request))
                return await handler(request)
            except Exception as exc:  # noqa: BLE001 - every error becomes its HTTP answer here
                return refusal(request, exc)

        return guarded


def _address(request: Request) -> str:
    return request.client.host if request.client is not None else "unknown"


def create_app(orchestrator: OpenAIBackend, *, served_model_name: str | None = None,
               tokens: Collection[str] = (), tenants: Tenants | None = None) -> FastAPI:
    """The ASGI app over `orchestrator` (orchestrator.speculation.Orchestrator or alike)."""
    door = OpenAIFrontDoor(orchestrator, served_model_name=served_model_name, tokens=tokens, tenants=tenants)
    app = FastAPI(title="specdec", summary="OpenAI-compatible API of a specdec orchestrator",
                  docs_url=None, redoc_url=None, openapi_url=None)
    app.router.route_class = GuardedRoute
    app.state.door = door

    # The router's own refusals (404 unknown path, 405 wrong method) come here, answered in place;
    # validation errors are answered by GuardedRoute, this handler is a backstop.
    @app.exception_handler(StarletteHTTPException)
    @app.exception_handler(RequestValidationError)
    async def _refused(request: Request, exc: Exception) -> Response:
        return refusal(request, exc)

    @app.exception_handler(Exception)
    async def _any_error(request: Request, exc: Exception) -> JSONResponse:
        # Only an error outside every route gets here; uvicorn logs its traceback (a bug: 500).
        return _error_response(500, "internal_error", "internal error (details in the server log)")

    @app.get("/health")
    async def health() -> JSONResponse:
        try:
            await orchestrator.ensure_serving()
        except Exception as exc:  # noqa: BLE001 - not serving: the reason, as a gRPC client would read it
            return _error_response(503, "service_unavailable_error", status_for(exc)[1])
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        target = getattr(orchestrator, "target_info", None)
        entry = {"id": door.model_name, "object": "model", "created": door.created, "owned_by": "specdec"}
        if target is not None and target.max_context:
            entry["max_model_len"] = target.max_context
        return JSONResponse({"object": "list", "data": [entry]})

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Any:
        door.check_model(body.model)
        samples = body.generation_requests()
        return await _respond(door, samples, request.state.caller, chat=False, prompts=len(body.prompts()),
                              stream=body.stream, include_usage=_include_usage(body))

    @app.post(CHAT_PATH)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        door.check_model(body.model)
        samples = body.generation_requests(orchestrator.config.max_new_tokens_limit)
        return await _respond(door, samples, request.state.caller, chat=True, prompts=1, stream=body.stream,
                              include_usage=_include_usage(body))

    return app


def refusal(request: Request, exc: Exception) -> Response:
    """The OpenAI error response for `exc`, logged once (rate-limited; a traceback only for a 500)."""
    chat = request.url.path.rstrip("/") == CHAT_PATH
    headers = None
    param = code = None
    if isinstance(exc, RequestValidationError):
        status, error_type = 400, "invalid_request_error"
        message, param = _invalid_body(exc)
    elif isinstance(exc, StarletteHTTPException):
        if isinstance(exc.__cause__, ClientDisconnect):  # the client left mid-body; no one reads this
            return _error_response(400, "invalid_request_error", "the client closed the request")
        status, error_type, message = _http_refusal(request, exc)
        headers = exc.headers
    else:
        status, error_type, message = http_error(exc)
        if status == 400:
            param = param_of(message, chat=chat)
        code = "model_not_found" if status == 404 else ("invalid_api_key" if status == 401 else None)
    REFUSALS.record(status, request.method, request.url.path, message, exc)
    return _error_response(status, error_type, message, code=code, param=param, headers=headers)


def _invalid_body(exc: RequestValidationError) -> tuple[str, str | None]:
    """(message, param) of a body that failed validation: the first error, naming its field."""
    first = exc.errors()[0] if exc.errors() else {}
    if first.get("type") == "json_invalid":
        reason = (first.get("ctx") or {}).get("error", "JSON decode error")
        return f"the body is not valid JSON: {reason} (at character {first['loc'][-1]})", None
    where = _field_path(first.get("loc", ()))
    message = str(first.get("msg", "invalid value"))
    if where and first.get("type", "").endswith("_type") and "got" not in message:
        message = f"{message}, got {json_kind(first.get('input'))}"
    if not where:
        body = first.get("input")
        if isinstance(body, bytes | str):  # not parsed: no JSON Content-Type
            return "the body must be a JSON object, sent with Content-Type: application/json", None
        return f"the body must be a JSON object, got {json_kind(body)}", None
    return f"{where}: {message}", where


def _field_path(loc: Sequence[Any]) -> str:
    """A pydantic error location as the body's field path ("messages[0].role"), union tags left out."""
    path = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif not _type_tag(part):
            path += f".{part}" if path else str(part)
    return path


def _http_refusal(request: Request, exc: StarletteHTTPException) -> tuple[int, str, str]:
    """(status, type, message) of a refusal raised as an HTTPException (router, body parsing)."""
    status = exc.status_code
    path = request.url.path
    where = f"{request.method} {path if len(path) <= 200 else path[:200] + '…'}"
    if status == 404:
        return 404, "invalid_request_error", f"invalid URL ({where})"
    if status == 405:
        allowed = (exc.headers or {}).get("Allow") or (exc.headers or {}).get("allow")
        return 405, "invalid_request_error", f"method not allowed ({where}); allowed: {allowed or 'none'}"
    if status == 400 and isinstance(exc.__cause__, UnicodeError):
        return 400, "invalid_request_error", "the body is not valid UTF-8 (a JSON body is UTF-8)"
    if status == 400:
        return 400, "invalid_request_error", "the body could not be read as JSON"
    error_type = "invalid_request_error" if status < 500 else "internal_error"
    return status, error_type, str(exc.detail)


def _type_tag(part: Any) -> bool:
    """Whether a pydantic error location part names a union branch ("str", "list[int]"), not a field."""
    return isinstance(part, str) and ("[" in part or part in {"str", "int", "float", "bool", "list", "dict"})


def _include_usage(body: Any) -> bool:
    return bool(body.stream_options and body.stream_options.include_usage)


async def _respond(door: OpenAIFrontDoor, samples: list[GenerationRequest], caller: Caller, *, chat: bool,
                   prompts: int, stream: bool, include_usage: bool) -> Any:
    orchestrator = door.orchestrator
    await orchestrator.ensure_serving()  # UNAVAILABLE (503) before any work, as the gRPC gate does
    created, model = int(time.time()), door.model_name
    # One id for the response; its samples are stored as <id>-<i> (resumable over gRPC by that id).
    base = uuid.uuid4().hex
    samples = [replace(sample, request_id=f"{base}-{i}") for i, sample in enumerate(samples)]
    response_id = f"{'chatcmpl' if chat else 'cmpl'}-{base}"
    if not stream:
        results = await _all_results(orchestrator, samples, caller)
        body = (responses.chat_completion(response_id, created, model, results) if chat
                else responses.completion(response_id, created, model, results, prompts))
        return JSONResponse(body)
    chunks = merged_chunks([orchestrator.generate_stream(sample, owner=caller.owner, caller=caller.key)
                            for sample in samples])
    try:
        first = await anext(chunks)  # a refused request still gets its HTTP status, not a 200 stream
    except BaseException:
        await chunks.aclose()
        raise
    events = responses.StreamChunks(response_id, created, model, chat)
    config = getattr(orchestrator, "config", None)
    return EventStream(_events(events, first, chunks, len(samples), prompts, include_usage),
                       idle_timeout_s=float(getattr(config, "stream_idle_timeout_s", 0.0) or 0.0),
                       name=response_id)


async def _all_results(orchestrator: OpenAIBackend, samples: Sequence[GenerationRequest],
                       caller: Caller) -> list[GenerationResult]:
    """All samples at once (each takes its own request slot); the first error cancels the rest."""
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(orchestrator.generate(sample, owner=caller.owner, caller=caller.key))
                     for sample in samples]
    except BaseExceptionGroup as errors:  # the samples' first error is the response's
        raise errors.exceptions[0] from None
    return [task.result() for task in tasks]


async def merged_chunks(streams: Sequence[AsyncIterator[GenerationChunk]],
                        ) -> AsyncGenerator[tuple[int, GenerationChunk], None]:
    """(choice index, chunk) as the streams produce them, one at a time; an error of any ends the
    merge with it, and every stream is closed however the merge ends."""
    queue: asyncio.Queue[tuple[int, GenerationChunk | None, BaseException | None]] = asyncio.Queue(
        maxsize=len(streams))

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
        # Shielded: a cancel scope that cancels this again (Starlette's on a disconnect) must not
        # cancel the tasks twice, which would cut their streams' clean-up short.
        await asyncio.shield(asyncio.gather(*tasks, return_exceptions=True))


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


class _ReaderIdle(Exception):
    """A write to the client waited longer than the idle timeout."""


class EventStream(StreamingResponse):
    """An SSE response that takes the next event only once the client has read all but a few kB of
    the earlier ones (openai_http.connections), so an unread stream's runs pause within a few events.
    Its body is closed however the response ends: all sent, the client gone
    (Starlette cancels the sending on http.disconnect, and would leave the body unclosed had it been
    waiting in a write), or a write that waits door_write_timeout(idle_timeout_s) because the client
    reads nothing (its runs were closed after idle_timeout_s), after which the connection is closed.
    Closing the body closes the requests' streams, so their runs, slots and engine sessions are freed
    at once."""

    def __init__(self, body: AsyncIterator[str], *, idle_timeout_s: float, name: str) -> None:
        super().__init__(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.body = body
        self.idle_timeout_s = idle_timeout_s
        self.name = name

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def timed_send(message: Message) -> None:
            try:
                async with asyncio.timeout(door_write_timeout(self.idle_timeout_s)):
                    if message.get("type") == "http.response.body":  # pull no more while it is unread
                        await wait_until_read(scope.get("client"))
                    await send(message)
            except TimeoutError:
                raise _ReaderIdle() from None

        try:
            await super().__call__(scope, receive, timed_send)
        except _ReaderIdle:  # uvicorn closes the connection of a response left incomplete
            log.info("closed stream %s: its client read nothing for %g s", self.name,
                     door_write_timeout(self.idle_timeout_s))
        finally:
            with anyio.CancelScope(shield=True):
                await self.body.aclose()  # type: ignore[attr-defined]


def http_error(exc: BaseException) -> tuple[int, str, str]:
    """(HTTP status, OpenAI error type, message) of an exception, through its gRPC status."""
    code, message = status_for(exc)
    status, error_type = responses.HTTP_STATUS.get(code.name, (500, "internal_error"))
    if isinstance(exc, NotFound) and message.startswith("model "):
        return 404, "invalid_request_error", message
    return status, error_type, message


def _error_response(status: int, error_type: str, message: str, *, code: str | None = None,
                    param: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(responses.error_body(message, error_type, code=code, param=param),
                        status_code=status, headers=headers)

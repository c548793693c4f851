"""Serving the HTTP API with uvicorn inside the orchestrator's own event loop.

uvicorn runs as a task beside the gRPC server: the process owner (serve_until_signal) handles
SIGINT/SIGTERM and stops both, so uvicorn installs no signal handlers of its own here. Bodies are
capped before they are read into memory (uvicorn has no limit of its own): a request body over
`max_body_bytes` gets 413 with an OpenAI error body, whether its Content-Length says so or it is
chunked and crosses the limit as it streams in.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import ssl
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import uvicorn

from orchestrator.metrics import HttpMetrics, http_route
from orchestrator.openai_http.connections import UnreadAwareH11
from orchestrator.openai_http.errors import REFUSALS

log = logging.getLogger(__name__)


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:  # the process owner handles signals
        yield


class BodyLimit:
    """ASGI middleware: 413 for a body over `limit` bytes, by Content-Length or as it streams in.

    A chunked body is counted as it arrives: at the byte past the limit the 413 is sent at once and
    the app is told the client left (`http.disconnect`), so it reads no further and whatever it
    answers then is dropped; uvicorn discards the rest of the body without keeping it.
    """

    def __init__(self, app: Any, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or ()).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await self._refuse(scope, send, f"{int(declared)} bytes declared")
            return
        seen = 0
        started = refused = False

        async def counted_receive() -> dict:
            nonlocal seen, refused
            if refused:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    refused = True
                    if not started:
                        await self._refuse(scope, send, f"over {self.limit} bytes streamed")
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message: dict) -> None:
            nonlocal started
            if refused and not started:
                return  # the 413 was the answer
            started = started or message["type"] == "http.response.start"
            await send(message)

        await self.app(scope, counted_receive, guarded_send)

    async def _refuse(self, scope: dict, send: Any, seen: str) -> None:
        message = f"request body over {self.limit} bytes"
        REFUSALS.record(413, scope.get("method", ""), scope.get("path", ""), f"{message} ({seen})")
        body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                     "code": "request_too_large"}}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


CLIENT_CLOSED = 499  # nginx's "client closed request": the request ended before any answer


class RequestMetrics:
    """ASGI middleware: each HTTP request's route, status and time to its last byte, on `metrics`
    (orchestrator.metrics.HttpMetrics). Outermost, so refusals by BodyLimit count too; a request
    that ends without a response (the client went away first) counts as status 499, nginx's
    "client closed request"."""

    def __init__(self, app: Any, metrics: HttpMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = http_route(scope.get("path", ""))
        status: int | None = None  # until the response starts
        began = time.perf_counter()

        async def tracked_send(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        self.metrics.started(route)
        try:
            await self.app(scope, receive, tracked_send)
        except BaseException:
            status = 500 if status is None else status
            raise
        finally:
            self.metrics.finished(route, CLIENT_CLOSED if status is None else status,
                                  time.perf_counter() - began)


@dataclass(frozen=True)
class HttpTls:
    """HTTPS for the HTTP port: the gRPC port's certificate and key, and for mTLS its client CA."""

    cert: str
    key: str
    client_ca: str | None = None
    require_client_cert: bool = False


class HttpServer:
    """A running uvicorn server; `stop()` ends it (open streams are closed after `grace_s`)."""

    def __init__(self, server: _Server, task: asyncio.Task, port: int) -> None:
        self._server = server
        self._task = task
        self.port = port

    async def stop(self, grace_s: float = 5.0) -> None:
        self._server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self._task), grace_s)
        except TimeoutError:
            self._server.force_exit = True
            with contextlib.suppress(asyncio.CancelledError, TimeoutError):
                await asyncio.wait_for(self._task, 1.0)
        except asyncio.CancelledError:
            pass


async def start_http_server(app: Any, host: str = "127.0.0.1", port: int = 8000, *,
                            max_body_bytes: int = 8 * 2**20, tls: HttpTls | None = None,
                            metrics: HttpMetrics | None = None) -> HttpServer:
    """Bind now (an OSError for a port in use reaches the caller), then serve in a task; with
    `metrics`, every request is counted on it (RequestMetrics)."""
    options: dict[str, Any] = {}
    if tls is not None:
        options.update(ssl_certfile=tls.cert, ssl_keyfile=tls.key)
        if tls.client_ca is not None:
            options.update(ssl_ca_certs=tls.client_ca,
                           ssl_cert_reqs=ssl.CERT_REQUIRED if tls.require_client_cert else ssl.CERT_OPTIONAL)
    served: Any = BodyLimit(app, max_body_bytes)
    if metrics is not None:
        served = RequestMetrics(served, metrics)
    config = uvicorn.Config(served, host=host, port=port, lifespan="off", http=UnreadAwareH11,
                            access_log=False, log_level="warning", log_config=None,
                            timeout_graceful_shutdown=5, **options)
    sock = config.bind_socket()
    server = _Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]), name=f"http {host}:{port}")
    for _ in range(500):  # bounded: startup is a few milliseconds
        if server.started or task.done():
            break
        await asyncio.sleep(0.01)
    if task.done():
        task.result()  # raises what stopped it
    return HttpServer(server, task, sock.getsockname()[1])

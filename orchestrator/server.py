"""gRPC adapter for the orchestrator's public API (GenerationService).

`orchestrator` is any GenerationBackend (below: generate, generate_stream, resume, resume_stream;
orchestrator.speculation.Orchestrator provides it), and a MonitoredBackend to have its health follow
its dependencies. `owner` is the caller's identity
(specdec.rpc.security.caller_identity: its bearer token or client certificate, as a digest): the
stored request is bound to it, so only the same identity can resume it; the per-caller cap counts
the call under it, or under the peer's address for an anonymous caller (admission.CALLER_KEY).
Errors map to status codes as documented in specdec/rpc/grpc_support.py; a lost verifier or request
store (PeerUnavailable) becomes UNAVAILABLE.

A streamed answer's run is paced by this door's writes (admission.paced): a client that reads nothing,
so that gRPC's flow control holds a write, has its run paused without a request slot and, after the
orchestrator's stream_idle_timeout_s, closed (freed and resumable); the client gets RESOURCE_EXHAUSTED
after the chunks already sent once it reads again. The handlers stay async generators, which server
interceptors that wrap streaming handlers (OpenTelemetry's) require.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterable
from typing import Any, Protocol, TypeGuard

import grpc

from orchestrator.admission import Caller
from orchestrator.health import HealthMonitor, Monitored, ServingGate
from specdec.defaults import DEFAULT_MAX_MESSAGE_MB
from specdec.generation import GenerationChunk, GenerationRequest, GenerationResult
from specdec.rpc import generation_convert
from specdec.rpc.grpc_support import (
    guarded,
    guarded_stream,
    serve_until_signal,
    start_server,
)
from specdec.rpc.security import caller_identity
from specdec.rpc.tenants import Tenants, common_name
from specdec.rpc.v1 import generation_pb2, generation_pb2_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = generation_pb2.DESCRIPTOR.services_by_name["GenerationService"].full_name


class GenerationBackend(Protocol):
    """What the GenerationService calls on the orchestrator: the door depends on these four calls
    only (a test's stand-in needs no more). Streams are closed when the call ends."""

    async def generate(self, request: GenerationRequest, *, owner: str, caller: str) -> GenerationResult: ...

    def generate_stream(self, request: GenerationRequest, *, owner: str,
                        caller: str) -> AsyncIterator[GenerationChunk]: ...

    async def resume(self, request_id: str, *, owner: str, caller: str) -> GenerationResult: ...

    def resume_stream(self, request_id: str, *, owner: str,
                      caller: str) -> AsyncIterator[GenerationChunk]: ...


class HealthSettings(Protocol):
    """The one setting the health rounds read of a monitored orchestrator's config."""

    @property
    def health_interval_s(self) -> float: ...


class MonitoredBackend(GenerationBackend, Monitored, Protocol):
    """A GenerationBackend that watches its verifier and store (check_dependencies, ensure_serving):
    its health status follows them and its calls are gated on them."""

    @property
    def config(self) -> HealthSettings: ...


def _monitored(orchestrator: GenerationBackend) -> TypeGuard[MonitoredBackend]:
    """Whether the orchestrator watches its dependencies (a plain stand-in need not)."""
    return hasattr(orchestrator, "check_dependencies")


class GenerationServicer(generation_pb2_grpc.GenerationServiceServicer):
    def __init__(self, orchestrator: GenerationBackend, tenants: Tenants | None = None) -> None:
        self.tenants = tenants
        self.orchestrator = orchestrator

    @guarded
    async def Generate(
        self, request: generation_pb2.GenerationRequest, context
    ) -> generation_pb2.GenerationResult:
        return await self._result(self.orchestrator.generate, _generation_request, request, context)

    @guarded_stream
    def GenerateStream(
        self, request: generation_pb2.GenerationRequest, context
    ) -> AsyncIterator[generation_pb2.GenerationChunk]:
        return self._chunks(self.orchestrator.generate_stream, _generation_request, request, context)

    @guarded
    async def Resume(
        self, request: generation_pb2.ResumeRequest, context
    ) -> generation_pb2.GenerationResult:
        return await self._result(self.orchestrator.resume, _resume_request, request, context)

    @guarded_stream
    def ResumeStream(
        self, request: generation_pb2.ResumeRequest, context
    ) -> AsyncIterator[generation_pb2.GenerationChunk]:
        return self._chunks(self.orchestrator.resume_stream, _resume_request, request, context)

    async def _result(self, call: Callable[..., Awaitable[GenerationResult]], convert: Callable[[Any], Any],
                      request: Any, context: grpc.aio.ServicerContext) -> generation_pb2.GenerationResult:
        """A unary call: the request converted, the backend called as the caller, the result converted."""
        result = await call(convert(request), **_caller(context, self.tenants))
        return generation_convert.generation_result_to_proto(result)

    async def _chunks(
        self, call: Callable[..., AsyncIterator[GenerationChunk]], convert: Callable[[Any], Any],
        request: Any, context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[generation_pb2.GenerationChunk]:
        """A streaming call, as _result; converted inside the stream, so a bad request is refused by
        the stream's guard like any error, and the backend's stream is closed however this ends."""
        stream = call(convert(request), **_caller(context, self.tenants))
        async with contextlib.aclosing(_chunks(stream)) as chunks:
            async for chunk in chunks:
                yield chunk


_generation_request = generation_convert.generation_request_from_proto
_resume_request = generation_convert.resume_request_from_proto


def _caller(context: grpc.aio.ServicerContext, tenants: Tenants | None = None) -> dict[str, str]:
    """The backend call's `owner` (the caller's identity: its tenant's when `tenants` names its
    credential) and `caller` (the per-caller cap's key: the identity, or "peer:<address>", port left
    out, for an anonymous caller)."""
    owner = caller_identity(context)
    if tenants is not None:
        owner = tenants.identity(owner, common_name(context))
    who = Caller.of(owner, _address(context.peer() or ""))
    return {"owner": who.owner, "caller": who.key}


def _address(peer: str) -> str:
    """ "ipv4:127.0.0.1:5000" → "ipv4:127.0.0.1", "ipv6:[::1]:5000" → "ipv6:[::1]"; others as they are."""
    kind, _, rest = peer.partition(":")
    if kind in ("ipv4", "ipv6") and ":" in rest:
        return f"{kind}:{rest.rsplit(':', 1)[0]}"
    return peer


async def _chunks(
    stream: AsyncIterator[GenerationChunk],
) -> AsyncGenerator[generation_pb2.GenerationChunk, None]:
    """The orchestrator's chunks as messages; the stream is closed however this ends."""
    if inspect.iscoroutine(stream):  # tolerate `async def generate_stream(...)` returning an iterator
        stream = await stream
    try:
        async for chunk in stream:
            yield generation_convert.generation_chunk_to_proto(chunk)
    finally:
        # The client may cancel mid-stream: close the generator so the orchestrator releases
        # its sessions (and the request's lease) now rather than at garbage collection.
        aclose = getattr(stream, "aclose", None)
        if aclose is not None:
            await aclose()


async def start_orchestrator_server(
    orchestrator: GenerationBackend,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    max_message_mb: float = DEFAULT_MAX_MESSAGE_MB,
    interceptors: Iterable[grpc.aio.ServerInterceptor] = (),
    credentials: grpc.ServerCredentials | None = None,
    health_interval_s: float | None = None,
    tenants: Tenants | None = None,
) -> tuple[grpc.aio.Server, int]:
    """Start a GenerationService (+ health, reflection); returns (server, bound port).

    An orchestrator that watches its dependencies (`check_dependencies`, orchestrator.speculation)
    gets a health status that follows them (orchestrator.health.HealthMonitor, a round every
    `health_interval_s`, default its config's): NOT_SERVING from the start until its verifier
    answers; and its calls are answered UNAVAILABLE before any work while the verifier is not there
    (ServingGate, after `interceptors`)."""
    servicer = GenerationServicer(orchestrator, tenants)
    monitor = gate = None
    if _monitored(orchestrator):
        interval = health_interval_s or orchestrator.config.health_interval_s
        monitor = HealthMonitor(orchestrator, interval, [SERVICE_NAME])
        gate = ServingGate(orchestrator, f"/{SERVICE_NAME}/")
    server, bound = await start_server(
        lambda server: generation_pb2_grpc.add_GenerationServiceServicer_to_server(servicer, server),
        [SERVICE_NAME],
        host,
        port,
        max_message_mb=max_message_mb,
        interceptors=[*interceptors, *([gate] if gate is not None else [])],
        credentials=credentials,
        on_stop=[monitor.stop] if monitor is not None else [],
    )
    if monitor is not None:
        await monitor.start(server)
    return server, bound


async def serve_orchestrator(orchestrator: GenerationBackend, host: str = "127.0.0.1", port: int = 50050, *,
                             grace_s: float = 5.0, **kwargs: Any) -> None:
    """Serve until SIGINT/SIGTERM, then stop gracefully (health → NOT_SERVING, drain calls)."""
    server, _ = await start_orchestrator_server(orchestrator, host, port, **kwargs)
    await serve_until_signal(server, grace_s)

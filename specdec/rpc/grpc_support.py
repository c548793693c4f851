"""What every specdec gRPC server and client shares: options, startup, shutdown, error handling.

The mapping of exceptions to statuses and back lives in specdec.rpc.status (torch-free, for the
light client); import its names from there. Servers use `guarded` / `guarded_stream` /
`abort_with` so that every handler answers the mapped status and logs what the client is not told.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import gc
import inspect
import logging
import signal
import time
import weakref
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import Any, TypeVar
from weakref import WeakKeyDictionary

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from specdec.defaults import DEFAULT_MAX_MESSAGE_MB
from specdec.errors import EngineError
from specdec.rpc import convert
from specdec.rpc.channel import message_options
from specdec.rpc.status import (
    short_details,
    status_for,
)
from specdec.rpc.v1 import common_pb2

log = logging.getLogger(__name__)

T = TypeVar("T")


def format_address(host: str, port: int) -> str:
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"  # IPv6 literal
    return f"{host}:{port}"


# ------------------------------------------------------------------------------ server side


async def abort_with(context: grpc.aio.ServicerContext, exc: BaseException, rpc: str) -> None:
    """Abort the call with the status of `exc`; the server log line keeps what the client is not told
    (a peer's address: EngineError.address)."""
    code, message = status_for(exc)
    if code == grpc.StatusCode.INTERNAL:
        log.error("%s failed", rpc, exc_info=exc)
    elif isinstance(exc, EngineError) and exc.address is not None:
        log.info("%s: %s %s (from %s: %s)", rpc, code.name, message, exc.address, short_details(str(exc)))
    else:
        log.info("%s: %s %s", rpc, code.name, message)
    await context.abort(code, message)


def guarded(rpc: Callable[..., Any]) -> Callable[..., Any]:
    """Decorator for unary servicer methods: any exception becomes the mapped status."""

    @functools.wraps(rpc)
    async def wrapper(self, request, context):
        try:
            return await rpc(self, request, context)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - mapped to a status, logged when unexpected
            if isinstance(exc, grpc.aio.AbortError):
                raise
            await abort_with(context, exc, rpc.__name__)

    return wrapper


def guarded_stream(rpc: Callable[..., AsyncIterator[Any]]) -> Callable[..., AsyncIterator[Any]]:
    """Decorator for server-streaming servicer methods (async generators)."""

    @functools.wraps(rpc)
    async def wrapper(self, request, context):
        stream = rpc(self, request, context)
        try:
            async for item in stream:
                yield item
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001
            if isinstance(exc, grpc.aio.AbortError):
                raise
            await abort_with(context, exc, rpc.__name__)
        finally:
            await stream.aclose()

    return wrapper


async def run_blocking(executor: Executor | None, fn: Callable[..., T], *args: Any) -> T:
    """Run a synchronous engine call off the event loop, keeping contextvars (trace context)."""
    loop = asyncio.get_running_loop()
    call = functools.partial(contextvars.copy_context().run, fn, *args)
    return await loop.run_in_executor(executor, call)


class EngineServicer:
    """What the drafter and verifier services share: their engine, the worker pool its calls run
    in, the observers told about every call, and the Info and Release RPCs.

    Listed first among a servicer's bases, so these methods implement the generated ones.
    """

    def __init__(self, engine: Any, executor: Executor | None = None, observers: Sequence[Any] = ()) -> None:
        self.engine = engine
        self.executor = executor
        # Told about every engine call (orchestrator.tracing.ServiceObserver: spans, metrics).
        self.observers = tuple(observers)

    @guarded
    async def Info(self, request: common_pb2.InfoRequest, context: Any) -> common_pb2.ModelInfo:
        return convert.model_info_to_proto(await run_blocking(self.executor, self.engine.info))

    @guarded
    async def Release(self, request: common_pb2.ReleaseRequest, context: Any) -> common_pb2.ReleaseResponse:
        await run_blocking(self.executor, self.engine.release, request.session_id)
        return common_pb2.ReleaseResponse()


async def run_observed(
    executor: Executor | None, observers: Sequence[Any], rpc: str, request: Any, fn: Callable[..., T],
    *args: Any,
) -> T:
    """run_blocking, then tell each observer (tracing, metrics) what the engine call did.

    observer.observe(rpc, request, result, error, start_ns, end_ns) gets the real start/end
    of the call in its worker thread (time.time_ns); it runs on the event loop, in the
    handler's context (the server span of the call is current there).
    """
    if not observers:
        return await run_blocking(executor, fn, *args)
    times = [0, 0]

    def timed() -> T:
        times[0] = time.time_ns()
        try:
            return fn(*args)
        finally:
            times[1] = time.time_ns()

    result: Any = None
    error: BaseException | None = None
    try:
        result = await run_blocking(executor, timed)
        return result
    except BaseException as exc:  # cancellation included: the caller gave up
        error = exc
        raise
    finally:
        now = time.time_ns()
        start, end = times[0] or now, times[1] or now
        for observer in observers:
            try:
                observer.observe(rpc, request, result, error, start, end)
            except Exception:  # observability never fails a call
                log.exception("observer %r failed on %s", observer, rpc)


_ON_STOP: WeakKeyDictionary[grpc.aio.Server, list[Callable[[], None]]] = WeakKeyDictionary()
_HEALTH: WeakKeyDictionary[grpc.aio.Server, health.aio.HealthServicer] = WeakKeyDictionary()


def add_on_stop(server: grpc.aio.Server, callback: Callable[[], None]) -> None:
    """Run `callback` after stop_server stops `server` (or when it is collected), as start_server's
    `on_stop` callbacks: e.g. shut down a worker pool of one of its servicers."""
    weakref.finalize(server, callback)
    _ON_STOP.setdefault(server, []).append(callback)


# ---------------------------------------------------------------- requests that do not parse


class MalformedRequest:
    """What a request whose bytes do not parse becomes (instead of grpc's UNKNOWN status with a
    traceback at ERROR, one per call): its handler then answers INVALID_ARGUMENT, logging one line."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


def _tolerant(deserializer: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception as exc:  # noqa: BLE001 - DecodeError, or whatever else a parser raises
            return MalformedRequest(short_details(str(exc) or type(exc).__name__))

    return parse


async def _refuse_malformed(
    context: grpc.aio.ServicerContext, request: MalformedRequest, method: str
) -> None:
    message = f"malformed request: {request.reason}"
    log.info("%s: INVALID_ARGUMENT %s", method, message)
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)


def _refusing_malformed(behavior: Callable[..., Any], method: str) -> Callable[..., Any] | None:
    """`behavior` answering a MalformedRequest itself; None for a kind it cannot wrap (synchronous)."""
    if inspect.isasyncgenfunction(behavior):

        async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            if isinstance(request, MalformedRequest):
                await _refuse_malformed(context, request, method)
            responses = behavior(request, context)
            try:
                async for response in responses:
                    yield response
            finally:
                await responses.aclose()

        return stream
    if inspect.iscoroutinefunction(behavior):

        async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if isinstance(request, MalformedRequest):
                await _refuse_malformed(context, request, method)
            return await behavior(request, context)

        return unary
    return None


def guard_parsing(handler: grpc.RpcMethodHandler | None, method: str) -> grpc.RpcMethodHandler | None:
    """`handler` with a request parser that never raises: bytes that do not parse get INVALID_ARGUMENT
    "malformed request: …" and one log line. Handlers of streamed requests, synchronous behaviours
    or none of a parser stay as they are."""
    if (handler is None or handler.request_streaming or handler.request_deserializer is None
            or not hasattr(handler, "_replace")):
        return handler
    kind = "unary_stream" if handler.response_streaming else "unary_unary"
    behavior = _refusing_malformed(getattr(handler, kind), method)
    if behavior is None:
        return handler
    return handler._replace(request_deserializer=_tolerant(handler.request_deserializer), **{kind: behavior})


class _GuardedGeneric(grpc.GenericRpcHandler):
    def __init__(self, inner: grpc.GenericRpcHandler) -> None:
        self._inner = inner

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        return guard_parsing(self._inner.service(handler_call_details), handler_call_details.method)


class _ParsingGuard:
    """The server as the generated add_*_to_server functions see it: every handler added through it
    goes through guard_parsing."""

    def __init__(self, server: grpc.aio.Server) -> None:
        self._server = server

    def add_generic_rpc_handlers(self, handlers: Iterable[grpc.GenericRpcHandler]) -> None:
        self._server.add_generic_rpc_handlers(tuple(_GuardedGeneric(handler) for handler in handlers))

    def add_registered_method_handlers(
        self, service: str, handlers: dict[str, grpc.RpcMethodHandler]
    ) -> None:
        self._server.add_registered_method_handlers(
            service, {name: guard_parsing(h, f"/{service}/{name}") for name, h in handlers.items()})

    def __getattr__(self, name: str) -> Any:
        return getattr(self._server, name)


async def start_server(
    register: Callable[[grpc.aio.Server], None],
    service_names: Sequence[str],
    host: str,
    port: int,
    *,
    max_message_mb: float = DEFAULT_MAX_MESSAGE_MB,
    interceptors: Iterable[grpc.aio.ServerInterceptor] = (),
    options: Iterable[tuple[str, Any]] = (),
    on_stop: Sequence[Callable[[], None]] = (),
    credentials: grpc.ServerCredentials | None = None,
) -> tuple[grpc.aio.Server, int]:
    """Build, register, bind and start a grpc.aio server with health checking and reflection.

    `register(server)` adds the service's servicer. Health reports SERVING for "" and for every
    name in `service_names`. `credentials` (specdec.rpc.security.server_credentials) binds a TLS
    port; None binds plaintext. `on_stop` callbacks run after stop_server (or when the server
    object is collected). Returns the server and the bound port (useful with port=0).
    """
    server = grpc.aio.server(
        interceptors=list(interceptors),
        # No SO_REUSEPORT: a second server on a busy port must fail, not silently share it.
        options=[*message_options(max_message_mb), ("grpc.so_reuseport", 0), *options],
    )
    guarded_server = _ParsingGuard(server)  # bytes that do not parse: INVALID_ARGUMENT, one log line
    register(guarded_server)  # type: ignore[arg-type]
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, guarded_server)
    reflected = [*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME]
    reflection.enable_server_reflection(reflected, server)
    address = format_address(host, port)
    try:
        if credentials is None:
            bound = server.add_insecure_port(address)
        else:
            bound = server.add_secure_port(address, credentials)
    except RuntimeError as exc:  # grpc raises RuntimeError when the port cannot be bound
        raise OSError(f"could not bind {address}: {exc}") from None
    if bound == 0:
        raise OSError(f"could not bind {address}")
    await server.start()
    for callback in on_stop:
        weakref.finalize(server, callback)
    _ON_STOP[server] = list(on_stop)
    for name in ("", *service_names):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    _HEALTH[server] = health_servicer
    log.info("serving %s on %s", ", ".join(service_names), format_address(host, bound))
    return server, bound


async def set_health(server: grpc.aio.Server, serving: bool, service_names: Sequence[str] = ()) -> bool:
    """Report SERVING or NOT_SERVING for "" and each of `service_names` (a server whose status
    follows its dependencies: orchestrator.health). False when the server was stopped, or is
    stopping: it then reports NOT_SERVING for good."""
    health_servicer = _HEALTH.get(server)
    if health_servicer is None:
        return False
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ("", *service_names):
        await health_servicer.set(name, status)
    return True


async def stop_server(server: grpc.aio.Server, grace_s: float = 5.0) -> None:
    """Report NOT_SERVING first (load balancers stop routing), then let in-flight calls finish."""
    health_servicer = _HEALTH.pop(server, None)
    if health_servicer is not None:
        await health_servicer.enter_graceful_shutdown()
    await server.stop(grace_s)
    for callback in _ON_STOP.pop(server, []):
        callback()


def freeze_startup_objects() -> None:
    """Move what a serving process has loaded (torch, transformers, the model: it lives as long as
    the process) out of the garbage collector's sight, once, before the process says it is ready.

    A full collection that scanned it all took ~250 ms and landed inside a request at random (a
    verifier's Score went from 40 ms to 250–300 ms once per run, tests/observability/test_pipeline.py).
    Before readiness, because the collection itself blocks the event loop: done after it, a health
    check that came at once read the orchestrator's first state (NOT_SERVING)."""
    gc.collect()
    gc.freeze()


async def serve_until_signal(server: grpc.aio.Server, grace_s: float = 5.0) -> None:
    """Run until SIGINT/SIGTERM (or the server terminates), then stop gracefully."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    installed = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(sig, stop.set)
            installed.append(sig)
    stop_task = asyncio.ensure_future(stop.wait())
    done_task = asyncio.ensure_future(server.wait_for_termination())
    try:
        await asyncio.wait({stop_task, done_task}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)
        stop_task.cancel()
        log.info("shutting down (grace %.1f s)", grace_s)
        await stop_server(server, grace_s)
        # Not cancelled above: grpc's wait_for_termination shares its future with shutdown.
        await asyncio.wait({done_task}, timeout=grace_s + 5.0)


def engine_workers(engine: Any) -> int:
    """Worker threads an engine's calls should run in: its batching config's, else 1."""
    return int(getattr(getattr(engine, "batching", None), "workers", 1))


async def start_engine_server(
    make_servicer: Callable[[Executor], Any],
    add_to_server: Callable[[Any, grpc.aio.Server], None],
    service_name: str,
    host: str,
    port: int,
    *,
    max_message_mb: float = DEFAULT_MAX_MESSAGE_MB,
    interceptors: Iterable[grpc.aio.ServerInterceptor] = (),
    max_workers: int = 1,
    thread_name_prefix: str = "engine",
    credentials: grpc.ServerCredentials | None = None,
    initializer: Callable[[], object] | None = None,
) -> tuple[grpc.aio.Server, int]:
    """start_server for a servicer around a synchronous engine, with its own worker pool (each of
    whose threads runs `initializer` first: specdec.runtime.compute_thread.serial_torch)."""
    if max_workers < 1:
        raise ValueError(f"max_workers must be >= 1, got {max_workers}")
    executor = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=thread_name_prefix,
                                  initializer=initializer)
    servicer = make_servicer(executor)
    try:
        return await start_server(
            lambda server: add_to_server(servicer, server),
            [service_name],
            host,
            port,
            max_message_mb=max_message_mb,
            interceptors=interceptors,
            on_stop=[functools.partial(executor.shutdown, wait=False)],
            credentials=credentials,
        )
    except BaseException:
        executor.shutdown(wait=False)
        raise

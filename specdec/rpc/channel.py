"""A client's side of one gRPC channel: options, security, deadlines and status → exception mapping.

What every specdec client shares, the engine clients (orchestrator.clients.grpc_client) and the light
client (specdec.client) alike. A client never hangs: every call carries a deadline (`timeout_s`) and
fails fast when the peer is down (wait_for_ready=False). Status codes map back to the exceptions the
in-process transport raises (specdec.rpc.status.error_from_status): UNAVAILABLE / DEADLINE_EXCEEDED →
PeerUnavailable (naming the address), FAILED_PRECONDITION → SessionGone, INVALID_ARGUMENT →
InvalidRequest, …, anything else → RemoteError (an EngineError carrying the code).

Channels are plaintext unless a specdec.rpc.security.ClientSecurity says TLS / mTLS; its bearer token
goes with every call (health checks included, which need none).

GrpcClient (grpc.aio) opens its channel lazily on first use inside the running event loop (a grpc.aio
channel belongs to one loop) and reopens it if used from another loop. SyncGrpcClient (blocking grpc)
opens its channel at construction and may be shared between threads.

Light on purpose (grpc and protobuf, no torch): the light client builds on it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.defaults import DEFAULT_MAX_MESSAGE_MB
from specdec.errors import EngineError, InvalidRequest
from specdec.rpc.security import AUTHORIZATION_HEADER, ClientSecurity
from specdec.rpc.status import UPSTREAM, error_from_status

DEFAULT_TIMEOUT_S = 60.0
# gRPC's reconnect backoff grows to 120 s by default; a peer that `specdec up` (or Kubernetes)
# restarts should be found within a couple of seconds, which is what these caps give.
RECONNECT_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 250), ("grpc.max_reconnect_backoff_ms", 2000)]
HEALTH_TIMEOUT_S = 2.0
MB = 1024 * 1024
T = TypeVar("T")
V = TypeVar("V")


def message_options(max_message_mb: float) -> list[tuple[str, int]]:
    """Channel/server options that raise both message-size limits to `max_message_mb`."""
    limit = int(max_message_mb * MB)
    if limit <= 0:
        raise ValueError(f"max_message_mb must be > 0, got {max_message_mb}")
    return [("grpc.max_send_message_length", limit), ("grpc.max_receive_message_length", limit)]


def encode_request(fn: Callable[[V], T], value: V) -> T:
    """Encode a request; a value protobuf cannot hold (e.g. an id beyond int32) is a bad request."""
    try:
        return fn(value)
    except EngineError:
        raise
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from None


def _serving_status(response: health_pb2.HealthCheckResponse) -> str:
    return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)


class _ClientBase:
    """What both flavours keep: the address, the deadline, the channel options and the security."""

    _service_name: str = ""
    _role: str = UPSTREAM  # how its errors name the peer to the caller's own clients

    def __init__(self, address: str, *, timeout_s: float, max_message_mb: float,
                 options: Iterable[tuple[str, Any]], security: ClientSecurity | None) -> None:
        if not isinstance(address, str) or not address:
            raise ValueError(f"address must be host:port, got {address!r}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.address = address
        self.timeout_s = timeout_s
        self._options = [*message_options(max_message_mb), *RECONNECT_OPTIONS, *options]
        self._security = security if security is not None else ClientSecurity()

    def _error(self, err: grpc.RpcError) -> EngineError:
        return error_from_status(err.code(), err.details(), self.address, self._role)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.address!r})"


class GrpcClient(_ClientBase):
    """One lazily opened grpc.aio channel + stub, deadlines on every call, status → exception mapping."""

    _stub_class: Any = None

    def __init__(
        self,
        address: str,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        max_message_mb: float = DEFAULT_MAX_MESSAGE_MB,
        interceptors: Iterable[grpc.aio.ClientInterceptor] = (),
        options: Iterable[tuple[str, Any]] = (),
        security: ClientSecurity | None = None,
    ) -> None:
        """`security`: TLS / mTLS and the bearer token of the channel (default: plaintext, no token)."""
        super().__init__(address, timeout_s=timeout_s, max_message_mb=max_message_mb, options=options,
                         security=security)
        self._interceptors = list(interceptors)
        self._channel: grpc.aio.Channel | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stub: Any = None

    def _open(self) -> Any:
        loop = asyncio.get_running_loop()
        if self._channel is None or self._loop is not loop:
            # A channel from a loop that is gone cannot be closed from here; let it be collected.
            self._channel = self._security.channel(self.address, self._options, self._interceptors)
            self._loop = loop
            self._stub = self._stub_class(self._channel)
        return self._stub

    async def _unary(self, method: str, request: Any, timeout_s: float | None = None) -> Any:
        stub = self._open()
        try:
            return await getattr(stub, method)(
                request, timeout=timeout_s or self.timeout_s, wait_for_ready=False
            )
        except grpc.aio.AioRpcError as err:
            raise self._error(err) from None

    async def health(self, timeout_s: float = HEALTH_TIMEOUT_S) -> str:
        """The standard health status of this client's service: "SERVING", "NOT_SERVING", …;
        PeerUnavailable when nothing answers."""
        self._open()
        stub = health_pb2_grpc.HealthStub(self._channel)
        try:
            response = await stub.Check(
                health_pb2.HealthCheckRequest(service=self._service_name),
                timeout=timeout_s,
                wait_for_ready=False,
            )
        except grpc.aio.AioRpcError as err:
            raise self._error(err) from None
        return _serving_status(response)

    async def is_serving(self, timeout_s: float = HEALTH_TIMEOUT_S) -> bool:
        """Standard health check of this client's service; False on any failure."""
        try:
            return await self.health(timeout_s) == "SERVING"
        except EngineError:
            return False

    async def close(self) -> None:
        channel, self._channel, self._stub = self._channel, None, None
        if channel is not None and self._loop is asyncio.get_running_loop():
            await channel.close()
        self._loop = None

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


class SyncGrpcClient(_ClientBase):
    """One blocking grpc channel + stub, deadlines on every call, status → exception mapping.

    The bearer token goes as call metadata (grpc.aio's token interceptors do not apply here)."""

    _stub_class: Any = None

    def __init__(
        self,
        address: str,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        max_message_mb: float = DEFAULT_MAX_MESSAGE_MB,
        interceptors: Iterable[Any] = (),
        options: Iterable[tuple[str, Any]] = (),
        security: ClientSecurity | None = None,
    ) -> None:
        """`interceptors`: grpc (not grpc.aio) client interceptors; `security` as for GrpcClient."""
        super().__init__(address, timeout_s=timeout_s, max_message_mb=max_message_mb, options=options,
                         security=security)
        token = self._security.token
        self._metadata: tuple[tuple[str, str], ...] = (
            ((AUTHORIZATION_HEADER, f"Bearer {token}"),) if token else ())
        channel = self._security.sync_channel(address, self._options)
        interceptors = list(interceptors)
        self._channel: grpc.Channel | None = (
            grpc.intercept_channel(channel, *interceptors) if interceptors else channel)
        self._stub: Any = self._stub_class(self._channel)

    def _live_stub(self) -> Any:
        if self._channel is None:
            raise RuntimeError(f"{self!r} is closed")
        return self._stub

    def _unary(self, method: str, request: Any, timeout_s: float | None = None) -> Any:
        stub = self._live_stub()
        try:
            return getattr(stub, method)(request, timeout=timeout_s or self.timeout_s,
                                         metadata=self._metadata, wait_for_ready=False)
        except grpc.RpcError as err:
            raise self._error(err) from None

    def health(self, timeout_s: float = HEALTH_TIMEOUT_S) -> str:
        """As GrpcClient.health, blocking."""
        self._live_stub()
        stub = health_pb2_grpc.HealthStub(self._channel)
        try:
            response = stub.Check(health_pb2.HealthCheckRequest(service=self._service_name),
                                  timeout=timeout_s, metadata=self._metadata, wait_for_ready=False)
        except grpc.RpcError as err:
            raise self._error(err) from None
        return _serving_status(response)

    def is_serving(self, timeout_s: float = HEALTH_TIMEOUT_S) -> bool:
        """Standard health check of this client's service; False on any failure."""
        try:
            return self.health(timeout_s) == "SERVING"
        except EngineError:
            return False

    def close(self) -> None:
        channel, self._channel, self._stub = self._channel, None, None
        if channel is not None:
            channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

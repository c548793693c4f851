"""gRPC transport of the client protocols (orchestrator.clients.base) and the CLI's client.

A client never hangs: every call carries a deadline (`timeout_s`) and fails fast when the peer
is down (wait_for_ready=False). Status codes map back to the exceptions the in-process
transport raises: UNAVAILABLE / DEADLINE_EXCEEDED → PeerUnavailable (naming the address),
FAILED_PRECONDITION → SessionGone, INVALID_ARGUMENT → InvalidRequest, anything else →
specdec.rpc.grpc_support.RemoteError (an EngineError carrying the code).

Channels are plaintext unless a specdec.rpc.security.ClientSecurity says TLS / mTLS; its bearer
token goes with every call (health checks included, which need none).

Channels are opened lazily on first use inside the running event loop (a grpc.aio channel
belongs to one loop) and reopened if the client is used from another loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.defaults import DEFAULT_MAX_MESSAGE_MB
from specdec.engine.api import (
    DraftRequest,
    DraftResult,
    EngineError,
    InvalidRequest,
    LookaheadRequest,
    LookaheadResult,
    ModelInfo,
    ScoreRequest,
    VerifyOutcome,
    VerifyRequest,
)
from specdec.generation import GenerationChunk, GenerationRequest, GenerationResult
from specdec.rpc import convert
from specdec.rpc.grpc_support import error_from_status, message_options
from specdec.rpc.security import ClientSecurity
from specdec.rpc.v1 import (
    common_pb2,
    drafter_pb2_grpc,
    generation_pb2_grpc,
    verifier_pb2,
    verifier_pb2_grpc,
)

DEFAULT_TIMEOUT_S = 60.0
# gRPC's reconnect backoff grows to 120 s by default; a peer that `specdec up` (or Kubernetes)
# restarts should be found within a couple of seconds, which is what these caps give.
RECONNECT_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 250), ("grpc.max_reconnect_backoff_ms", 2000)]
DEFAULT_GENERATION_TIMEOUT_S = 600.0
HEALTH_TIMEOUT_S = 2.0


class _GrpcClient:
    """One lazily opened channel + stub, deadlines on every call, status → exception mapping."""

    _stub_class: Any = None
    _service_name: str = ""
    _role: str = "upstream service"  # how its errors name the peer to the caller's own clients

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
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.address = address
        self.timeout_s = timeout_s
        self._options = [*message_options(max_message_mb), *RECONNECT_OPTIONS, *options]
        self._interceptors = list(interceptors)
        self._security = security if security is not None else ClientSecurity()
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

    def _error(self, err: grpc.aio.AioRpcError) -> EngineError:
        return error_from_status(err.code(), err.details(), self.address, self._role)

    async def _unary(self, method: str, request: Any, timeout_s: float | None = None) -> Any:
        stub = self._open()
        try:
            return await getattr(stub, method)(
                request, timeout=timeout_s or self.timeout_s, wait_for_ready=False
            )
        except grpc.aio.AioRpcError as err:
            raise self._error(err) from None

    async def is_serving(self, timeout_s: float = HEALTH_TIMEOUT_S) -> bool:
        """Standard health check of this client's service; False on any failure."""
        self._open()
        stub = health_pb2_grpc.HealthStub(self._channel)
        try:
            response = await stub.Check(
                health_pb2.HealthCheckRequest(service=self._service_name),
                timeout=timeout_s,
                wait_for_ready=False,
            )
        except grpc.aio.AioRpcError:
            return False
        return response.status == health_pb2.HealthCheckResponse.SERVING

    async def close(self) -> None:
        channel, self._channel, self._stub = self._channel, None, None
        if channel is not None and self._loop is asyncio.get_running_loop():
            await channel.close()
        self._loop = None

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.address!r})"


def _encode(fn, value):
    """Encode a request; a value protobuf cannot hold (e.g. an id beyond int32) is a bad request."""
    try:
        return fn(value)
    except EngineError:
        raise
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from None


class GrpcDrafterClient(_GrpcClient):
    """DrafterClient over gRPC."""

    _stub_class = drafter_pb2_grpc.DrafterServiceStub
    _service_name = "specdec.v1.DrafterService"
    _role = "drafter"

    async def info(self) -> ModelInfo:
        return convert.model_info_from_proto(await self._unary("Info", common_pb2.InfoRequest()))

    async def draft(self, request: DraftRequest) -> DraftResult:
        msg = _encode(convert.draft_request_to_proto, request)
        return convert.draft_result_from_proto(await self._unary("Draft", msg))

    async def lookahead(self, request: LookaheadRequest) -> LookaheadResult:
        msg = _encode(convert.lookahead_request_to_proto, request)
        return convert.lookahead_result_from_proto(await self._unary("Lookahead", msg))

    async def release(self, session_id: str) -> None:
        await self._unary("Release", common_pb2.ReleaseRequest(session_id=session_id))


class GrpcVerifierClient(_GrpcClient):
    """VerifierClient over gRPC."""

    _stub_class = verifier_pb2_grpc.VerifierServiceStub
    _service_name = "specdec.v1.VerifierService"
    _role = "verifier"

    async def info(self) -> ModelInfo:
        return convert.model_info_from_proto(await self._unary("Info", common_pb2.InfoRequest()))

    async def score(self, request: ScoreRequest) -> None:
        await self._unary("Score", _encode(convert.score_request_to_proto, request))

    async def verify(self, request: VerifyRequest) -> VerifyOutcome:
        msg = _encode(convert.verify_request_to_proto, request)
        return convert.verify_outcome_from_proto(await self._unary("Verify", msg))

    async def tokenize(self, text: str) -> list[int]:
        response = await self._unary("Tokenize", verifier_pb2.TokenizeRequest(text=text))
        return list(response.token_ids)

    async def decode(self, token_ids: list[int]) -> str:
        msg = _encode(lambda ids: verifier_pb2.DecodeRequest(token_ids=[int(i) for i in ids]), token_ids)
        return (await self._unary("Decode", msg)).text

    async def release(self, session_id: str) -> None:
        await self._unary("Release", common_pb2.ReleaseRequest(session_id=session_id))


class GenerationClient(_GrpcClient):
    """Client of the orchestrator's GenerationService (used by the CLI)."""

    _stub_class = generation_pb2_grpc.GenerationServiceStub
    _service_name = "specdec.v1.GenerationService"
    _role = "orchestrator"

    def __init__(
        self, address: str, *, timeout_s: float = DEFAULT_GENERATION_TIMEOUT_S, **kwargs: Any
    ) -> None:
        super().__init__(address, timeout_s=timeout_s, **kwargs)

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        msg = _encode(convert.generation_request_to_proto, request)
        return convert.generation_result_from_proto(await self._unary("Generate", msg))

    async def generate_stream(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        """Chunks as the orchestrator emits them; the deadline covers the whole stream."""
        msg = _encode(convert.generation_request_to_proto, request)
        async for chunk in self._chunks("GenerateStream", msg):
            yield chunk

    async def resume(self, request_id: str) -> GenerationResult:
        """Continue this caller's stored request (NotFound: none; StillRunning: a live run holds it)."""
        msg = _encode(convert.resume_request_to_proto, request_id)
        return convert.generation_result_from_proto(await self._unary("Resume", msg))

    async def resume_stream(self, request_id: str) -> AsyncIterator[GenerationChunk]:
        """As resume, streamed: the first chunk carries the tokens stored so far, then one per iteration."""
        msg = _encode(convert.resume_request_to_proto, request_id)
        async for chunk in self._chunks("ResumeStream", msg):
            yield chunk

    async def _chunks(self, method: str, msg: Any) -> AsyncIterator[GenerationChunk]:
        """A server-streaming call's chunks; the deadline covers the whole stream."""
        call = getattr(self._open(), method)(msg, timeout=self.timeout_s, wait_for_ready=False)
        try:
            async for chunk in call:
                yield convert.generation_chunk_from_proto(chunk)
        except grpc.aio.AioRpcError as err:
            raise self._error(err) from None
        finally:
            call.cancel()  # no-op when finished; frees the server when the consumer stops early

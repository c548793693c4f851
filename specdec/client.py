"""The light Python client of a running orchestrator (gRPC GenerationService); no torch, no numpy.

    from specdec.client import Client, InvalidRequest

    with Client("127.0.0.1:50050", token="…") as client:      # token / tls_ca=… only if the server wants them
        result = client.generate("def fib(n):", max_new_tokens=32, temperature=0)
        print(result.text, result.finish_reason, result.stats.acceptance_rate)
        for chunk in client.generate_stream("def add(a, b):", max_new_tokens=16):
            print(chunk.text, end="", flush=True)
        chat = client.generate(messages=[{"role": "user", "content": "Hi"}], max_new_tokens=16)

AsyncClient has the same methods as coroutines (`async with AsyncClient() as client:
await client.generate(…)`; `async for chunk in client.generate_stream(…)`). A request is a
GenerationRequest, or a prompt plus its fields as keywords (temperature / top_k / top_p stand for
`sampling`); method, k, a and pipeline left out (None) take the orchestrator's settings
(`--default-method`, `--default-k`, …), and `result.method` says which method ran. Failures raise the
errors the orchestrator itself raises, all EngineError: InvalidRequest (INVALID_ARGUMENT),
PeerUnavailable (UNAVAILABLE: no orchestrator, or its verifier is down), Overloaded (RESOURCE_EXHAUSTED:
retry later), Unauthenticated, NotFound, StillRunning, AlreadyExists, RemoteError.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import grpc

from specdec.errors import (
    AlreadyExists,
    EngineError,
    InvalidRequest,
    NotFound,
    Overloaded,
    PeerUnavailable,
    StillRunning,
    Unauthenticated,
)
from specdec.generation import (
    CHAT_ROLES,
    ChatMessage,
    GenerationChunk,
    GenerationRequest,
    GenerationResult,
    GenerationStats,
    IterationRecord,
)
from specdec.rpc import generation_convert as convert
from specdec.rpc.channel import GrpcClient, SyncGrpcClient, encode_request
from specdec.rpc.security import ClientSecurity
from specdec.rpc.status import RemoteError
from specdec.rpc.v1 import generation_pb2_grpc
from specdec.sampling_params import SamplingParams, SamplingParamsError

__all__ = [
    "DEFAULT_ADDRESS", "DEFAULT_TIMEOUT_S", "AlreadyExists", "AsyncClient", "ChatMessage", "Client",
    "EngineError", "GenerationChunk", "GenerationRequest", "GenerationResult", "GenerationStats",
    "InvalidRequest", "IterationRecord", "NotFound", "Overloaded", "PeerUnavailable", "RemoteError",
    "SamplingParams", "SamplingParamsError", "StillRunning", "Unauthenticated", "build_request",
]

DEFAULT_ADDRESS = "127.0.0.1:50050"  # where `specdec up` serves the orchestrator
DEFAULT_TIMEOUT_S = 600.0  # one whole request (a stream's deadline covers all of it)
SERVICE_NAME = "specdec.v1.GenerationService"
SAMPLING_FIELDS = ("temperature", "top_k", "top_p")
_REQUEST_FIELDS = frozenset(f.name for f in dataclasses.fields(GenerationRequest))


# ---------------------------------------------------------------------------------- requests


def build_request(prompt: str | GenerationRequest | None = None, /, **fields: Any) -> GenerationRequest:
    """A GenerationRequest from a prompt (or a request to start from) and request fields as keywords.

    `temperature`, `top_k` and `top_p` change the request's sampling; `messages` may hold ChatMessage
    or {"role": …, "content": …} mappings. Fields not given keep GenerationRequest's defaults: None for
    method, k, a and pipeline, so the orchestrator's own settings apply. InvalidRequest (naming the
    field) for what no request can hold; TypeError for an unknown keyword. What needs the model (the
    prompt's length, a method the server does not know) is the orchestrator's to check.
    """
    if isinstance(prompt, GenerationRequest):
        base = prompt
    elif prompt is None or isinstance(prompt, str):
        base = GenerationRequest()
        if prompt is not None:
            if "prompt" in fields:
                raise TypeError("give the prompt once: as the first argument or as prompt=")
            fields["prompt"] = prompt
    else:
        raise TypeError(f"prompt must be text or a GenerationRequest, got {type(prompt).__name__}")
    unknown = sorted(set(fields) - _REQUEST_FIELDS - set(SAMPLING_FIELDS))
    if unknown:
        raise TypeError(f"unknown request field(s) {', '.join(unknown)}; a request has "
                        f"{', '.join(sorted(_REQUEST_FIELDS | set(SAMPLING_FIELDS)))}")
    changes = {name: fields.pop(name) for name in SAMPLING_FIELDS if name in fields}
    if changes:
        if "sampling" in fields:
            raise TypeError("give sampling= or temperature / top_k / top_p, not both")
        try:
            fields["sampling"] = dataclasses.replace(base.sampling, **changes)
        except SamplingParamsError as exc:
            raise InvalidRequest(str(exc)) from None
    if fields.get("messages") is not None:
        fields["messages"] = chat_messages(fields["messages"])
    return dataclasses.replace(base, **fields)


def chat_messages(messages: Iterable[ChatMessage | Mapping[str, Any]]) -> list[ChatMessage]:
    """ChatMessages from ChatMessages or {"role", "content"} mappings; InvalidRequest naming the entry."""
    if isinstance(messages, (str, bytes, Mapping)):
        raise InvalidRequest("messages must be a list of {role, content} entries")
    out = []
    for i, message in enumerate(messages):
        if isinstance(message, Mapping):
            extra = sorted(set(message) - {"role", "content"})
            if extra:
                raise InvalidRequest(f"messages[{i}]: unknown key(s) {', '.join(extra)} "
                                     "(expected role, content)")
            message = ChatMessage(role=message.get("role"), content=message.get("content"))
        if not isinstance(message, ChatMessage):
            raise InvalidRequest(f"messages[{i}] must be a ChatMessage or a {{role, content}} mapping, "
                                 f"got {type(message).__name__}")
        if message.role not in CHAT_ROLES:
            raise InvalidRequest(f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, got "
                                 f"{message.role!r}")
        if not isinstance(message.content, str):
            raise InvalidRequest(f"messages[{i}].content must be text, got {type(message.content).__name__}")
        out.append(message)
    return out


def client_security(security: ClientSecurity | None, *, token: str | None, tls_ca: str | Path | None,
                    tls_client_cert: str | Path | None, tls_client_key: str | Path | None,
                    tls_server_name: str | None) -> ClientSecurity | None:
    """`security` as given, or one made of the keyword arguments (None: plaintext without a token).
    ValueError naming the argument when they do not fit together or a file cannot be read."""
    loose = (token, tls_ca, tls_client_cert, tls_client_key, tls_server_name)
    if security is not None:
        if any(value is not None for value in loose):
            raise ValueError("give security= or token / tls_ca / tls_client_cert / tls_client_key / "
                             "tls_server_name, not both")
        return security
    if all(value is None for value in loose):
        return None
    security = ClientSecurity(tls_ca=_path(tls_ca), client_cert=_path(tls_client_cert),
                              client_key=_path(tls_client_key), token=token, server_name=tls_server_name)
    _ = security.credentials  # reads and checks the TLS files now, naming the one that is wrong
    return security


def _path(value: str | Path | None) -> Path | None:
    return None if value is None else Path(value).expanduser()


def _request_message(prompt: str | GenerationRequest | None, fields: dict[str, Any]) -> Any:
    return encode_request(convert.generation_request_to_proto, build_request(prompt, **fields))


# ------------------------------------------------------------------------------------ async


class _GenerationService:
    """What both clients share: the service, and how their arguments become a channel's security."""

    _stub_class = generation_pb2_grpc.GenerationServiceStub
    _service_name = SERVICE_NAME
    _role = "orchestrator"

    def __init__(
        self,
        address: str = DEFAULT_ADDRESS,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        token: str | None = None,
        tls_ca: str | Path | None = None,
        tls_client_cert: str | Path | None = None,
        tls_client_key: str | Path | None = None,
        tls_server_name: str | None = None,
        security: ClientSecurity | None = None,
        **channel: Any,
    ) -> None:
        """`timeout_s`: seconds one request (a whole stream) may take. TLS: `tls_ca` verifies the server
        (a PEM file), `tls_client_cert` / `tls_client_key` for mTLS; `token`: the orchestrator's bearer
        token; or a prepared `security`. `channel`: max_message_mb, options, interceptors (grpc.aio ones
        for AsyncClient, grpc ones for Client)."""
        security = client_security(security, token=token, tls_ca=tls_ca, tls_client_cert=tls_client_cert,
                                   tls_client_key=tls_client_key, tls_server_name=tls_server_name)
        super().__init__(address, timeout_s=timeout_s, security=security, **channel)  # type: ignore[call-arg]


class AsyncClient(_GenerationService, GrpcClient):
    """The orchestrator's GenerationService from asyncio code; see the module docstring.

    The channel opens on first use in the running event loop; `close()` (or `async with`) closes it.
    """

    async def generate(self, prompt: str | GenerationRequest | None = None, /,
                       **fields: Any) -> GenerationResult:
        """Generate to the end; `prompt` and `fields` as for build_request."""
        msg = _request_message(prompt, fields)
        return convert.generation_result_from_proto(await self._unary("Generate", msg))

    async def generate_stream(self, prompt: str | GenerationRequest | None = None, /,
                              **fields: Any) -> AsyncIterator[GenerationChunk]:
        """Chunks as the orchestrator emits them (one per iteration; the last carries `result`)."""
        msg = _request_message(prompt, fields)
        async for chunk in self._chunks("GenerateStream", msg):
            yield chunk

    async def resume(self, request_id: str) -> GenerationResult:
        """Continue this caller's stored request (NotFound: none; StillRunning: a live run holds it);
        a finished one answers its stored result."""
        msg = encode_request(convert.resume_request_to_proto, request_id)
        return convert.generation_result_from_proto(await self._unary("Resume", msg))

    async def resume_stream(self, request_id: str) -> AsyncIterator[GenerationChunk]:
        """As resume, streamed: the first chunk carries the tokens stored so far, then one per iteration."""
        msg = encode_request(convert.resume_request_to_proto, request_id)
        async for chunk in self._chunks("ResumeStream", msg):
            yield chunk

    async def _chunks(self, method: str, msg: Any) -> AsyncIterator[GenerationChunk]:
        call = getattr(self._open(), method)(msg, timeout=self.timeout_s, wait_for_ready=False)
        try:
            async for chunk in call:
                yield convert.generation_chunk_from_proto(chunk)
        except grpc.aio.AioRpcError as err:
            raise self._error(err) from None
        finally:
            call.cancel()  # no-op when finished; frees the server when the consumer stops early


# ------------------------------------------------------------------------------------- sync


class Client(_GenerationService, SyncGrpcClient):
    """The orchestrator's GenerationService from blocking code (threads may share one); see the module
    docstring. The same arguments and methods as AsyncClient, without `await`."""

    def generate(self, prompt: str | GenerationRequest | None = None, /, **fields: Any) -> GenerationResult:
        """Generate to the end; `prompt` and `fields` as for build_request."""
        msg = _request_message(prompt, fields)
        return convert.generation_result_from_proto(self._unary("Generate", msg))

    def generate_stream(self, prompt: str | GenerationRequest | None = None, /,
                        **fields: Any) -> Iterator[GenerationChunk]:
        """Chunks as the orchestrator emits them (one per iteration; the last carries `result`). The
        request is checked at once and sent on the first next(); closing the iterator early cancels the
        call."""
        msg = _request_message(prompt, fields)
        return self._chunks("GenerateStream", msg)

    def resume(self, request_id: str) -> GenerationResult:
        """As AsyncClient.resume."""
        msg = encode_request(convert.resume_request_to_proto, request_id)
        return convert.generation_result_from_proto(self._unary("Resume", msg))

    def resume_stream(self, request_id: str) -> Iterator[GenerationChunk]:
        """As AsyncClient.resume_stream."""
        msg = encode_request(convert.resume_request_to_proto, request_id)
        return self._chunks("ResumeStream", msg)

    def _chunks(self, method: str, msg: Any) -> Iterator[GenerationChunk]:
        call = getattr(self._live_stub(), method)(msg, timeout=self.timeout_s, metadata=self._metadata,
                                                  wait_for_ready=False)
        try:
            for chunk in call:
                yield convert.generation_chunk_from_proto(chunk)
        except grpc.RpcError as err:
            raise self._error(err) from None
        finally:
            call.cancel()  # no-op when finished; frees the server when the consumer stops early

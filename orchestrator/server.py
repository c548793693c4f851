"""gRPC adapter for the orchestrator's public API (GenerationService).

`orchestrator` is any object with
    async def generate(request: GenerationRequest) -> GenerationResult
    def generate_stream(request: GenerationRequest) -> AsyncIterator[GenerationChunk]
(orchestrator.speculation provides it). Errors map to status codes as documented in
specdec/rpc/grpc_support.py; a lost verifier (PeerUnavailable) becomes UNAVAILABLE.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import AsyncIterator, Iterable
from typing import Any

import grpc

from specdec.defaults import DEFAULT_MAX_MESSAGE_MB
from specdec.rpc import convert
from specdec.rpc.grpc_support import (
    guarded,
    guarded_stream,
    serve_until_signal,
    start_server,
)
from specdec.rpc.v1 import generation_pb2, generation_pb2_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = generation_pb2.DESCRIPTOR.services_by_name["GenerationService"].full_name


class GenerationServicer(generation_pb2_grpc.GenerationServiceServicer):
    def __init__(self, orchestrator: Any) -> None:
        self.orchestrator = orchestrator

    @guarded
    async def Generate(
        self, request: generation_pb2.GenerationRequest, context
    ) -> generation_pb2.GenerationResult:
        result = await self.orchestrator.generate(convert.generation_request_from_proto(request))
        return convert.generation_result_to_proto(result)

    @guarded_stream
    async def GenerateStream(
        self, request: generation_pb2.GenerationRequest, context
    ) -> AsyncIterator[generation_pb2.GenerationChunk]:
        stream = self.orchestrator.generate_stream(convert.generation_request_from_proto(request))
        if inspect.iscoroutine(stream):  # tolerate `async def generate_stream(...)` returning an iterator
            stream = await stream
        try:
            async for chunk in stream:
                yield convert.generation_chunk_to_proto(chunk)
        finally:
            # The client may cancel mid-stream: close the generator so the orchestrator releases
            # its sessions now rather than at garbage collection.
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                await aclose()


async def start_orchestrator_server(
    orchestrator: Any,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    max_message_mb: float = DEFAULT_MAX_MESSAGE_MB,
    interceptors: Iterable[grpc.aio.ServerInterceptor] = (),
    credentials: grpc.ServerCredentials | None = None,
) -> tuple[grpc.aio.Server, int]:
    """Start a GenerationService (+ health, reflection); returns (server, bound port)."""
    servicer = GenerationServicer(orchestrator)
    return await start_server(
        lambda server: generation_pb2_grpc.add_GenerationServiceServicer_to_server(servicer, server),
        [SERVICE_NAME],
        host,
        port,
        max_message_mb=max_message_mb,
        interceptors=interceptors,
        credentials=credentials,
    )


async def serve_orchestrator(orchestrator: Any, host: str = "127.0.0.1", port: int = 50050, *,
                             grace_s: float = 5.0, **kwargs: Any) -> None:
    """Serve until SIGINT/SIGTERM, then stop gracefully (health → NOT_SERVING, drain calls)."""
    server, _ = await start_orchestrator_server(orchestrator, host, port, **kwargs)
    await serve_until_signal(server, grace_s)

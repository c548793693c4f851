"""A method handler that refuses a call before any work: what server interceptors answer with
(the token check, the orchestrator's serving gate). Light: grpc only."""

from __future__ import annotations

from typing import Any

import grpc


def refusing(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` (unary or streaming, either side) that answers `code`
    `message` without parsing the request (no deserializer: it arrives as bytes, unread)."""

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(code, message)

    async def stream(request: Any, context: grpc.aio.ServicerContext):
        await context.abort(code, message)
        yield  # pragma: no cover - abort raises; this only makes the function a generator

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(stream)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(unary)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(stream)
    return grpc.unary_unary_rpc_method_handler(unary)

"""gRPC adapter around a verifier engine: parse, call the engine off the loop, encode, map errors.

The engine (specdec.engine.verifier.VerifierEngine or anything with the same methods) is
synchronous; calls run in a worker pool so the event loop keeps serving health checks and
other sessions. Errors map to status codes as documented in specdec/rpc/grpc_support.py.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any

import grpc

from specdec.defaults import DEFAULT_MAX_MESSAGE_MB
from specdec.rpc import convert
from specdec.rpc.grpc_support import (
    EngineServicer,
    engine_workers,
    guarded,
    run_blocking,
    run_observed,
    start_engine_server,
)
from specdec.rpc.v1 import verifier_pb2, verifier_pb2_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = verifier_pb2.DESCRIPTOR.services_by_name["VerifierService"].full_name


class VerifierServicer(EngineServicer, verifier_pb2_grpc.VerifierServiceServicer):
    @guarded
    async def Score(self, request: verifier_pb2.ScoreRequest, context) -> verifier_pb2.ScoreResponse:
        req = convert.score_request_from_proto(request)
        await run_observed(self.executor, self.observers, "Score", req, self.engine.score, req)
        return verifier_pb2.ScoreResponse()

    @guarded
    async def Verify(self, request: verifier_pb2.VerifyRequest, context) -> verifier_pb2.VerifyOutcome:
        req = convert.verify_request_from_proto(request)
        outcome = await run_observed(self.executor, self.observers, "Verify", req, self.engine.verify, req)
        return convert.verify_outcome_to_proto(outcome)

    @guarded
    async def Tokenize(self, request: verifier_pb2.TokenizeRequest, context) -> verifier_pb2.TokenizeResponse:
        ids = await run_blocking(self.executor, self.engine.tokenize, request.text)
        return verifier_pb2.TokenizeResponse(token_ids=[int(i) for i in ids])

    @guarded
    async def Decode(self, request: verifier_pb2.DecodeRequest, context) -> verifier_pb2.DecodeResponse:
        text = await run_blocking(self.executor, self.engine.decode, list(request.token_ids))
        return verifier_pb2.DecodeResponse(text=text)


async def start_verifier_server(
    engine: Any,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    max_message_mb: float = DEFAULT_MAX_MESSAGE_MB,
    interceptors: Iterable[grpc.aio.ServerInterceptor] = (),
    max_workers: int | None = None,
    observers: Sequence[Any] = (),
    credentials: grpc.ServerCredentials | None = None,
) -> tuple[grpc.aio.Server, int]:
    """Start a VerifierService (+ health, reflection) for `engine`; returns (server, bound port).

    max_workers: threads running engine calls; default: the engine's `batching.workers` (many for
    a batching engine, whose calls share passes), else 1 (calls one at a time, safe for any engine). Stop with
    specdec.rpc.grpc_support.stop_server(server) (health goes NOT_SERVING first) or server.stop().
    observers: told about every engine call (tracing spans, metrics); see
    specdec.rpc.grpc_support.run_observed.
    """
    return await start_engine_server(
        lambda executor: VerifierServicer(engine, executor, observers),
        verifier_pb2_grpc.add_VerifierServiceServicer_to_server,
        SERVICE_NAME,
        host,
        port,
        max_message_mb=max_message_mb,
        interceptors=interceptors,
        max_workers=max_workers if max_workers is not None else engine_workers(engine),
        thread_name_prefix="verifier-engine",
        credentials=credentials,
    )


"""gRPC adapter around a drafter engine: parse, call the engine off the loop, encode, map errors.

The engine (specdec.engine.drafter.DrafterEngine or anything with DrafterBackend's methods) is
synchronous; calls run in a worker pool so the event loop keeps serving health checks and
other sessions. Errors map to status codes as documented in specdec/rpc/grpc_support.py.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Protocol, Unpack

import grpc

from specdec.engine import api  # the engine's side of each call (drafter_pb2: the wire's)
from specdec.errors import InvalidRequest
from specdec.rpc import convert, engine_service
from specdec.rpc.engine_service import EngineServerOptions, start_engine_service
from specdec.rpc.grpc_support import EngineServicer, guarded, run_observed, serve_until_signal
from specdec.rpc.v1 import drafter_pb2, drafter_pb2_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = drafter_pb2.DESCRIPTOR.services_by_name["DrafterService"].full_name


class DrafterBackend(Protocol):
    """What the DrafterService calls on its engine (specdec.engine.drafter.DrafterEngine), so that a
    stand-in engine in a test needs these and no more. Calls run in worker threads; an optional
    `batching.workers` sizes their pool (specdec.rpc.grpc_support.engine_workers)."""

    def info(self) -> api.ModelInfo: ...

    def release(self, session_id: str) -> bool: ...

    def draft(self, request: api.DraftRequest) -> api.DraftResult: ...

    def lookahead(self, request: api.LookaheadRequest) -> api.LookaheadResult: ...

    def draft_rows(self, request: api.DraftRowsRequest): ...


# Refuses an `append` longer than the context window or a `shape_parents` over the drafter's cap.
check_counts = functools.partial(engine_service.check_counts, role="drafter", tree_field="shape_parents")


class DrafterServicer(EngineServicer, drafter_pb2_grpc.DrafterServiceServicer):
    @guarded
    async def Draft(self, request: drafter_pb2.DraftRequest, context) -> drafter_pb2.DraftResult:
        check_counts(self.engine, "append", len(request.append), len(request.shape_parents))
        req = convert.draft_request_from_proto(request)
        result = await run_observed(self.executor, self.observers, "Draft", req, self.engine.draft, req)
        return convert.draft_result_to_proto(result)

    @guarded
    async def DraftRows(self, request: drafter_pb2.DraftRowsRequest, context):
        if len(request.rows) > api.MAX_TREE_NODES + 1:
            raise InvalidRequest(f"rows holds {len(request.rows)} indices; a draft has at most "
                                 f"{api.MAX_TREE_NODES + 1} rows")
        req = convert.draft_rows_request_from_proto(request)
        engine_call = self.engine.draft_rows
        rows = await run_observed(self.executor, self.observers, "DraftRows", req, engine_call, req)
        return convert.tensor_to_proto(rows, "rows")

    @guarded
    async def Lookahead(self, request: drafter_pb2.LookaheadRequest, context) -> drafter_pb2.LookaheadResult:
        check_counts(self.engine, "append", len(request.append))
        req = convert.lookahead_request_from_proto(request)
        engine_call = self.engine.lookahead
        result = await run_observed(self.executor, self.observers, "Lookahead", req, engine_call, req)
        return convert.lookahead_result_to_proto(result)


async def start_drafter_server(
    engine: DrafterBackend, host: str = "127.0.0.1", port: int = 0, **options: Unpack[EngineServerOptions]
) -> tuple[grpc.aio.Server, int]:
    """Start a DrafterService (+ health, reflection) for `engine`; returns (server, bound port).

    The options (worker pool, message size, interceptors, observers, credentials) are the verifier's
    too: specdec.rpc.engine_service.start_engine_service says what each does.
    """
    return await start_engine_service(
        engine,
        "drafter",
        lambda executor, observers: DrafterServicer(engine, executor, observers),
        drafter_pb2_grpc.add_DrafterServiceServicer_to_server,
        SERVICE_NAME,
        host,
        port,
        **options,
    )


async def serve_drafter(engine: DrafterBackend, host: str = "127.0.0.1", port: int = 50051, *,
                        grace_s: float = 5.0, **kwargs: Any) -> None:
    """Serve until SIGINT/SIGTERM, then stop gracefully (health → NOT_SERVING, drain calls)."""
    server, _ = await start_drafter_server(engine, host, port, **kwargs)
    await serve_until_signal(server, grace_s)

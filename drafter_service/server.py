"""gRPC adapter around a drafter engine: parse, call the engine off the loop, encode, map errors.

The engine (specdec.engine.drafter.DrafterEngine or anything with DrafterBackend's methods) is
synchronous; calls run in a worker pool so the event loop keeps serving health checks and
other sessions. Errors map to status codes as documented in specdec/rpc/grpc_support.py.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

import grpc

from specdec.defaults import DEFAULT_MAX_MESSAGE_MB
from specdec.engine.api import (
    MAX_TREE_NODES,
    DraftRequest,
    DraftResult,
    DraftRowsRequest,
    LookaheadRequest,
    LookaheadResult,
    ModelInfo,
)
from specdec.errors import ContextTooLong, InvalidRequest
from specdec.rpc import convert
from specdec.rpc.grpc_support import (
    EngineServicer,
    engine_workers,
    guarded,
    run_observed,
    serve_until_signal,
    start_engine_server,
)
from specdec.rpc.v1 import drafter_pb2, drafter_pb2_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = drafter_pb2.DESCRIPTOR.services_by_name["DrafterService"].full_name


class DrafterBackend(Protocol):
    """What the DrafterService calls on its engine (specdec.engine.drafter.DrafterEngine), so that a
    stand-in engine in a test needs these and no more. Calls run in worker threads; an optional
    `batching.workers` sizes their pool (specdec.rpc.grpc_support.engine_workers)."""

    def info(self) -> ModelInfo: ...

    def release(self, session_id: str) -> bool: ...

    def draft(self, request: DraftRequest) -> DraftResult: ...

    def lookahead(self, request: LookaheadRequest) -> LookaheadResult: ...

    def draft_rows(self, request: DraftRowsRequest): ...


def check_counts(engine: DrafterBackend, append: int, nodes: int = 0) -> None:
    """Refuse repeated fields no call may be that long, by their counts alone: before they are read
    into lists (a 64 MB message holds tens of millions of token ids) or the engine sees the call."""
    context = engine.info().max_context
    if context > 0 and append > context:
        raise ContextTooLong(f"append: {append} tokens; the context window holds {context}")
    if nodes > MAX_TREE_NODES:
        raise InvalidRequest(f"shape_parents holds {nodes} nodes; at most {MAX_TREE_NODES} are allowed "
                             "(the drafter's cap)")


class DrafterServicer(EngineServicer, drafter_pb2_grpc.DrafterServiceServicer):
    @guarded
    async def Draft(self, request: drafter_pb2.DraftRequest, context) -> drafter_pb2.DraftResult:
        check_counts(self.engine, len(request.append), len(request.shape_parents))
        req = convert.draft_request_from_proto(request)
        result = await run_observed(self.executor, self.observers, "Draft", req, self.engine.draft, req)
        return convert.draft_result_to_proto(result)

    @guarded
    async def DraftRows(self, request: drafter_pb2.DraftRowsRequest, context):
        if len(request.rows) > MAX_TREE_NODES + 1:
            raise InvalidRequest(f"rows holds {len(request.rows)} indices; a draft has at most "
                                 f"{MAX_TREE_NODES + 1} rows")
        req = convert.draft_rows_request_from_proto(request)
        engine_call = self.engine.draft_rows
        rows = await run_observed(self.executor, self.observers, "DraftRows", req, engine_call, req)
        return convert.tensor_to_proto(rows, "rows")

    @guarded
    async def Lookahead(self, request: drafter_pb2.LookaheadRequest, context) -> drafter_pb2.LookaheadResult:
        check_counts(self.engine, len(request.append))
        req = convert.lookahead_request_from_proto(request)
        engine_call = self.engine.lookahead
        result = await run_observed(self.executor, self.observers, "Lookahead", req, engine_call, req)
        return convert.lookahead_result_to_proto(result)


async def start_drafter_server(
    engine: DrafterBackend,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    max_message_mb: float = DEFAULT_MAX_MESSAGE_MB,
    interceptors: Iterable[grpc.aio.ServerInterceptor] = (),
    max_workers: int | None = None,
    observers: Sequence[Any] = (),
    credentials: grpc.ServerCredentials | None = None,
    worker_initializer: Callable[[], object] | None = None,
) -> tuple[grpc.aio.Server, int]:
    """Start a DrafterService (+ health, reflection) for `engine`; returns (server, bound port).

    max_workers: threads running engine calls; default: the engine's `batching.workers` (many for
    a batching engine, whose calls share passes), else 1 (calls one at a time, safe for any engine). Stop with
    specdec.rpc.grpc_support.stop_server(server) (health goes NOT_SERVING first) or server.stop().
    worker_initializer: run first by each engine worker thread (serve passes
    specdec.runtime.compute_thread.serial_torch: one OpenMP team per process).
    observers: told about every engine call (tracing spans, metrics); see
    specdec.rpc.grpc_support.run_observed.
    """
    return await start_engine_server(
        lambda executor: DrafterServicer(engine, executor, observers),
        drafter_pb2_grpc.add_DrafterServiceServicer_to_server,
        SERVICE_NAME,
        host,
        port,
        max_message_mb=max_message_mb,
        interceptors=interceptors,
        max_workers=max_workers if max_workers is not None else engine_workers(engine),
        thread_name_prefix="drafter-engine",
        credentials=credentials,
        initializer=worker_initializer,
    )


async def serve_drafter(engine: DrafterBackend, host: str = "127.0.0.1", port: int = 50051, *,
                        grace_s: float = 5.0, **kwargs: Any) -> None:
    """Serve until SIGINT/SIGTERM, then stop gracefully (health → NOT_SERVING, drain calls)."""
    server, _ = await start_drafter_server(engine, host, port, **kwargs)
    await serve_until_signal(server, grace_s)

"""What the drafter and verifier servers share around start_engine_server, written once: their
keyword options (EngineServerOptions), the start of a service whose worker pool defaults to the
engine's own (start_engine_service), and the refusal of repeated fields too long for any call
(check_counts). drafter_service and verifier_service may not import each other, so it lives here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Executor
from typing import Any, TypedDict

import grpc

from specdec.defaults import DEFAULT_MAX_MESSAGE_MB
from specdec.engine.api import MAX_TREE_NODES
from specdec.errors import ContextTooLong, InvalidRequest
from specdec.rpc.grpc_support import engine_workers, start_engine_server


class EngineServerOptions(TypedDict, total=False):
    """The keyword options of start_drafter_server and start_verifier_server (start_engine_service)."""

    max_message_mb: float
    interceptors: Iterable[grpc.aio.ServerInterceptor]
    max_workers: int | None
    observers: Sequence[Any]
    credentials: grpc.ServerCredentials | None
    worker_initializer: Callable[[], object] | None


async def start_engine_service(
    engine: Any,
    role: str,
    make_servicer: Callable[[Executor, Sequence[Any]], Any],
    add_to_server: Callable[[Any, grpc.aio.Server], None],
    service_name: str,
    host: str,
    port: int,
    *,
    max_message_mb: float = DEFAULT_MAX_MESSAGE_MB,
    interceptors: Iterable[grpc.aio.ServerInterceptor] = (),
    max_workers: int | None = None,
    observers: Sequence[Any] = (),
    credentials: grpc.ServerCredentials | None = None,
    worker_initializer: Callable[[], object] | None = None,
) -> tuple[grpc.aio.Server, int]:
    """Start `role`'s service (+ health, reflection) for `engine`; returns (server, bound port).

    make_servicer(executor, observers) builds the servicer around the engine's worker pool.
    max_workers: threads running engine calls; default: the engine's `batching.workers` (many for
    a batching engine, whose calls share passes), else 1 (calls one at a time, safe for any engine). Stop with
    specdec.rpc.grpc_support.stop_server(server) (health goes NOT_SERVING first) or server.stop().
    worker_initializer: run first by each engine worker thread (serve passes
    specdec.runtime.compute_thread.serial_torch: one OpenMP team per process).
    observers: told about every engine call (tracing spans, metrics); see
    specdec.rpc.grpc_support.run_observed.
    """
    return await start_engine_server(
        lambda executor: make_servicer(executor, observers),
        add_to_server,
        service_name,
        host,
        port,
        max_message_mb=max_message_mb,
        interceptors=interceptors,
        max_workers=max_workers if max_workers is not None else engine_workers(engine),
        thread_name_prefix=f"{role}-engine",
        credentials=credentials,
        initializer=worker_initializer,
    )


def check_counts(engine: Any, name: str, tokens: int, nodes: int = 0, *, role: str, tree_field: str) -> None:
    """Refuse repeated fields no call may be that long, by their counts alone: before they are read
    into lists (a 64 MB message holds tens of millions of token ids) or the engine sees the call.

    `name` holds `tokens` token ids (at most the context window); `tree_field` holds `nodes` tree
    nodes (at most MAX_TREE_NODES, `role`'s cap).
    """
    context = engine.info().max_context
    if context > 0 and tokens > context:
        raise ContextTooLong(f"{name}: {tokens} tokens; the context window holds {context}")
    if nodes > MAX_TREE_NODES:
        raise InvalidRequest(f"{tree_field} holds {nodes} nodes; at most {MAX_TREE_NODES} are allowed "
                             f"(the {role}'s cap)")

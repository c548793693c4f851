"""A small OTLP/gRPC trace receiver: `specdec trace-collect --port N --out spans.jsonl`.

It implements opentelemetry.proto.collector.trace.v1.TraceService (what every OTLP/gRPC
exporter sends to) and writes each received span as one JSON line, in the schema of the
`--trace-file` sink (orchestrator.tracing.span_to_dict), so `specdec trace-report` reads either.
Enough to look at one run without a tracing backend; not a replacement for a real collector.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.trace.v1 import trace_pb2

log = logging.getLogger(__name__)

SERVICE_NAME = "opentelemetry.proto.collector.trace.v1.TraceService"
DEFAULT_OTLP_PORT = 4317


# ============================================================================ OTLP → JSON


def any_value(value: common_pb2.AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind is None:
        return None
    if kind == "array_value":
        return [any_value(v) for v in value.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: any_value(kv.value) for kv in value.kvlist_value.values}
    if kind == "bytes_value":
        return base64.b64encode(value.bytes_value).decode()
    return getattr(value, kind)


def _attributes(pairs: Iterable[common_pb2.KeyValue]) -> dict[str, Any]:
    return {kv.key: any_value(kv.value) for kv in pairs}


_KINDS = {trace_pb2.Span.SPAN_KIND_UNSPECIFIED: "INTERNAL", trace_pb2.Span.SPAN_KIND_INTERNAL: "INTERNAL",
          trace_pb2.Span.SPAN_KIND_SERVER: "SERVER", trace_pb2.Span.SPAN_KIND_CLIENT: "CLIENT",
          trace_pb2.Span.SPAN_KIND_PRODUCER: "PRODUCER", trace_pb2.Span.SPAN_KIND_CONSUMER: "CONSUMER"}
_STATUS = {trace_pb2.Status.STATUS_CODE_UNSET: "UNSET", trace_pb2.Status.STATUS_CODE_OK: "OK",
           trace_pb2.Status.STATUS_CODE_ERROR: "ERROR"}


def otlp_to_dicts(request: trace_service_pb2.ExportTraceServiceRequest) -> list[dict[str, Any]]:
    """Every span of an OTLP export request in the JSON-lines schema of orchestrator.tracing."""
    spans = []
    for resource_spans in request.resource_spans:
        resource = _attributes(resource_spans.resource.attributes)
        service = str(resource.get("service.name", ""))
        for scope_spans in resource_spans.scope_spans:
            scope = scope_spans.scope.name
            for span in scope_spans.spans:
                spans.append({
                    "trace_id": span.trace_id.hex(),
                    "span_id": span.span_id.hex(),
                    "parent_span_id": span.parent_span_id.hex() or None,
                    "name": span.name,
                    "kind": _KINDS.get(span.kind, "INTERNAL"),
                    "start_ns": int(span.start_time_unix_nano),
                    "end_ns": int(span.end_time_unix_nano),
                    "status": _STATUS.get(span.status.code, "UNSET"),
                    "status_message": span.status.message,
                    "attributes": _attributes(span.attributes),
                    "events": [{"name": e.name, "time_ns": int(e.time_unix_nano),
                                "attributes": _attributes(e.attributes)} for e in span.events],
                    "service": service,
                    "resource": resource,
                    "scope": scope,
                })
    return spans


# ============================================================================ the receiver


class TraceCollector(trace_service_pb2_grpc.TraceServiceServicer):
    """Keeps received spans in memory (`spans`) and appends them to `out` (JSON lines) if given."""

    def __init__(self, out: str | Path | None = None,
                 on_spans: Callable[[list[dict[str, Any]]], None] | None = None) -> None:
        self.out = Path(out).expanduser().resolve() if out is not None else None
        if self.out is not None:
            self.out.parent.mkdir(parents=True, exist_ok=True)
        self.on_spans = on_spans
        self.spans: list[dict[str, Any]] = []
        self.requests = 0
        self._lock = threading.Lock()
        self._changed = asyncio.Event()

    async def Export(self, request: trace_service_pb2.ExportTraceServiceRequest, context: Any,
                     ) -> trace_service_pb2.ExportTraceServiceResponse:
        spans = otlp_to_dicts(request)
        with self._lock:
            self.requests += 1
            self.spans.extend(spans)
            if self.out is not None and spans:
                data = "".join(json.dumps(s, separators=(",", ":")) + "\n" for s in spans).encode()
                fd = os.open(self.out, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                try:
                    view = memoryview(data)
                    while view:
                        view = view[os.write(fd, view):]
                finally:
                    os.close(fd)
        if self.on_spans is not None:
            self.on_spans(spans)
        self._changed.set()
        return trace_service_pb2.ExportTraceServiceResponse()

    async def wait_for(self, predicate: Callable[[list[dict[str, Any]]], bool],
                       timeout_s: float | None) -> bool:
        """Wait until predicate(spans) holds (at most timeout_s; None = no bound); returns whether it did."""
        try:
            async with asyncio.timeout(timeout_s):
                while not predicate(list(self.spans)):
                    self._changed.clear()
                    await self._changed.wait()
        except TimeoutError:
            return predicate(list(self.spans))
        return True


async def start_collector(
    host: str = "127.0.0.1", port: int = DEFAULT_OTLP_PORT, out: str | Path | None = None,
    on_spans: Callable[[list[dict[str, Any]]], None] | None = None,
) -> tuple[grpc.aio.Server, int, TraceCollector]:
    """Start the OTLP/gRPC receiver (+ health); returns (server, bound port, collector)."""
    from specdec.rpc.grpc_support import start_server

    collector = TraceCollector(out, on_spans)
    server, bound = await start_server(
        lambda server: trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, server),
        [SERVICE_NAME], host, port,
    )
    return server, bound, collector


async def run_collector(host: str, port: int, out: str | Path, *, duration_s: float | None = None,
                        max_spans: int | None = None, ready: Callable[[int], None] | None = None,
                        grace_s: float = 2.0) -> TraceCollector:
    """Receive until SIGINT/SIGTERM, `duration_s` seconds, or `max_spans` spans; returns the collector."""
    from specdec.rpc.grpc_support import serve_until_signal

    server, bound, collector = await start_collector(host, port, out)
    if ready is not None:
        ready(bound)
    stoppers = []
    if duration_s is not None:
        stoppers.append(asyncio.ensure_future(asyncio.sleep(duration_s)))
    if max_spans is not None:
        stoppers.append(asyncio.ensure_future(
            collector.wait_for(lambda spans: len(spans) >= max_spans, timeout_s=None)))
    serving = asyncio.ensure_future(serve_until_signal(server, grace_s))
    try:
        if stoppers:
            await asyncio.wait([serving, *stoppers], return_when=asyncio.FIRST_COMPLETED)
            if not serving.done():
                from specdec.rpc.grpc_support import stop_server

                await stop_server(server, grace_s)
        await serving
    finally:
        for task in stoppers:
            task.cancel()
    return collector

"""OpenTelemetry tracing of requests, iterations and service calls (off unless configured).

What is traced (span names, attributes in `specdec.*`):
  specdec.request      one per run of a request (orchestrator); method, k, a, …, final statistics,
                       and the OpenTelemetry GenAI semantic-convention attributes (gen_ai.*, see
                       genai_request_attributes). The span keeps its name rather than semconv's
                       "{gen_ai.operation.name} {gen_ai.request.model}": trace-report, the tests
                       and saved traces find requests by it.
  specdec.iteration    one per speculation iteration, child of the request: iteration index,
                       method, source (where the draft came from: model, lookup, suffix; absent
                       for a target-only step), drafted, k, heads, accepted, emitted, a,
                       overlap_seconds, …
  specdec.draft        every drafter call of the iteration, with its real start/end
  specdec.verify       every verifier call (`specdec.call` = score | verify), real start/end
  gRPC client/server spans (opentelemetry-instrumentation-grpc) under the call spans, carrying
  W3C trace context in the gRPC metadata, and under the services' server spans:
  drafter.draft / verifier.verify / verifier.score   the engine call in its worker thread (real)
  drafter.forward / verifier.forward / verifier.verification   derived from the engine's own
                       timings (durations are measured, placement inside the call is derived:
                       `specdec.derived` = true)

Nothing here is imported by specdec/ (the core): the orchestrator loop calls a duck-typed
observer (`LoopObserver` below) and the service adapters call `observe(...)` on their
observers, so with tracing off nothing of this runs at all. `configure_tracing` returns None
when there is nowhere to send spans, and callers then install no interceptor and no observer.

OpenTelemetry itself is imported only where spans are made, i.e. once configure_tracing returned a
Tracing: with tracing off the services run without the opentelemetry packages (docs/gpu.md, "What
the services need"); asked for without them, configure_tracing raises TracingUnavailable.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from orchestrator.probes import IterationProbe, LoopObserver, RequestProbe
from specdec.defaults import DraftSource

if TYPE_CHECKING:
    from specdec.generation import GenerationResult, IterationRecord

log = logging.getLogger(__name__)

TRACER_NAME = "specdec"
REQUEST_SPAN = "specdec.request"
ITERATION_SPAN = "specdec.iteration"
DRAFT_SPAN = "specdec.draft"
VERIFY_SPAN = "specdec.verify"
CALL_SPANS = {"draft": DRAFT_SPAN, "verify": VERIFY_SPAN}
# gRPC calls that get no client/server spans: polling noise, and the verifier's Decode / Tokenize
# (a request's prompt and a resume's stored text: the timeline does not need them; the output's
# text comes with each Verify).
UNTRACED_SERVICES = frozenset({"grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection",
                               "grpc.reflection.v1.ServerReflection"})
UNTRACED_METHODS = frozenset({"Decode", "Tokenize"})
# OpenTelemetry GenAI semantic conventions: gen_ai.provider.name is the current name of what older
# conventions (and backends built on them) call gen_ai.system; both are set.
GENAI_PROVIDER = "specdec"
DEFAULT_MODEL = "default"
OPENAI_FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}


# ============================================================================ observer protocols


class ServiceObserver(Protocol):
    """What the service adapters call after every engine call (success or failure)."""

    def observe(self, rpc: str, request: Any, result: Any, error: BaseException | None,
                start_ns: int, end_ns: int) -> None: ...


def combine_observers(*observers: LoopObserver | None) -> LoopObserver | None:
    """One loop observer out of several (None entries are dropped; None when none is left)."""
    present = [o for o in observers if o is not None]
    if not present:
        return None
    if len(present) == 1:
        return present[0]
    return _CombinedObserver(present)


class _CombinedObserver:
    def __init__(self, observers: Sequence[LoopObserver]) -> None:
        self.observers = list(observers)

    def request_started(self, request_id: str, epoch: Callable[[float], float],
                        attributes: Mapping[str, Any]) -> RequestProbe | None:
        probes = [o.request_started(request_id, epoch, attributes) for o in self.observers]
        probes = [p for p in probes if p is not None]
        return _CombinedRequest(probes) if probes else None


class _CombinedRequest:
    def __init__(self, probes: list[RequestProbe]) -> None:
        self.probes = probes

    @contextmanager
    def iteration(self, index: int, start: float) -> Iterator[IterationProbe]:
        with ExitStack() as stack:
            yield _CombinedIteration([stack.enter_context(p.iteration(index, start)) for p in self.probes])

    def finished(self, result: GenerationResult | None, error: BaseException | None) -> None:
        for probe in self.probes:
            _safely(probe.finished, result, error)


class _CombinedIteration:
    def __init__(self, probes: list[IterationProbe]) -> None:
        self.probes = probes

    def call_started(self, kind: str, op: str, start: float) -> list[Any]:
        return [p.call_started(kind, op, start) for p in self.probes]

    def call_finished(self, token: list[Any], end: float, error: BaseException | None) -> None:
        for probe, item in zip(reversed(self.probes), reversed(token), strict=True):  # LIFO, like contexts
            _safely(probe.call_finished, item, end, error)

    def finished(self, record: IterationRecord, depth: int) -> None:
        for probe in self.probes:
            _safely(probe.finished, record, depth)


def _safely(fn: Any, *args: Any) -> None:
    """A hook that reports what happened must never fail the request it reports on."""
    try:
        fn(*args)
    except Exception:
        log.exception("observer %r failed", fn)


# ============================================================================ set-up

# What tracing imports (module → the package that installs it): not needed unless tracing is on.
TRACING_PACKAGES = {"opentelemetry.sdk": "opentelemetry-sdk",
                    "opentelemetry.instrumentation.grpc": "opentelemetry-instrumentation-grpc"}
OTLP_PACKAGES = {"opentelemetry.exporter.otlp": "opentelemetry-exporter-otlp"}


class TracingUnavailable(ValueError):
    """Tracing was asked for (a trace file, an OTLP endpoint, OTEL_* variables) but the OpenTelemetry
    packages are not installed; the message names the packages and how tracing was asked for."""


def missing_packages(modules: Mapping[str, str]) -> list[str]:
    """The packages of `modules` (module → package) that cannot be imported here (without importing them)."""
    missing = []
    for module, package in modules.items():
        try:
            found = importlib.util.find_spec(module) is not None
        except ImportError:  # a parent package is missing
            found = False
        if not found and package not in missing:
            missing.append(package)
    return missing


@dataclass
class Tracing:
    """A configured tracer provider and what the servers, clients and the loop need from it."""

    provider: Any  # opentelemetry.sdk.trace.TracerProvider
    service_name: str
    exporters: list[str] = field(default_factory=list)  # e.g. ["file:/tmp/spans.jsonl", "otlp-grpc:…"]

    def __post_init__(self) -> None:
        self.tracer = self.provider.get_tracer(TRACER_NAME)
        self._loop_tracer = LoopTracer(self.tracer)

    def server_interceptors(self) -> list[Any]:
        """grpc.aio server interceptors: continue the caller's trace, one SERVER span per RPC."""
        from opentelemetry.instrumentation.grpc import aio_server_interceptor

        return [aio_server_interceptor(tracer_provider=self.provider, filter_=_traced_rpc_filter())]

    def client_interceptors(self) -> list[Any]:
        """grpc.aio client interceptors: one CLIENT span per call, trace context in the metadata."""
        from opentelemetry.instrumentation.grpc import aio_client_interceptors

        return list(aio_client_interceptors(tracer_provider=self.provider, filter_=_traced_rpc_filter()))

    def loop_observer(self) -> LoopTracer:
        """The loop's observer (one per Tracing, so set_model reaches it whenever it was taken)."""
        return self._loop_tracer

    def set_model(self, name: str) -> None:
        """The served model name (gen_ai.request.model) of the request spans started from now on."""
        self._loop_tracer.set_model(name)

    def service_observer(self, role: str) -> EngineSpans:
        return EngineSpans(self.tracer, role)

    def force_flush(self, timeout_s: float = 10.0) -> bool:
        return bool(self.provider.force_flush(int(timeout_s * 1000)))

    def shutdown(self) -> None:
        """Flush and stop every exporter (call before the process exits; idempotent)."""
        with contextlib.suppress(Exception):
            self.provider.shutdown()


def _traced_rpc_filter() -> Any:
    """Which RPCs get client / server spans (the interceptors' filter_: True = trace)."""

    def traced(details: Any) -> bool:
        name = getattr(details, "method", "") or ""
        if isinstance(name, bytes):
            name = name.decode()
        service, _, method = name.lstrip("/").partition("/")
        return service not in UNTRACED_SERVICES and method not in UNTRACED_METHODS

    return traced


def _env_list(name: str) -> list[str]:
    return [part.strip().lower() for part in os.environ.get(name, "").split(",") if part.strip()]


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def otlp_settings(
    otlp_endpoint: str | None = None, protocol: str | None = None
) -> tuple[str, str | None] | None:
    """(protocol, endpoint) of the OTLP exporter to run, or None when OTLP export is off.

    On when an endpoint is given here or in OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT, or when
    OTEL_TRACES_EXPORTER names otlp; off when OTEL_TRACES_EXPORTER is none (or names no otlp).
    protocol: grpc (default) or http/protobuf, else OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL.
    """
    names = _env_list("OTEL_TRACES_EXPORTER")
    env_endpoint = (os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
                    or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"))
    if names and "otlp" not in names:
        return None
    if not names and not otlp_endpoint and not env_endpoint:
        return None
    protocol = (protocol or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
                or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc").strip().lower()
    if protocol not in ("grpc", "http/protobuf"):
        raise ValueError(f"OTLP protocol must be grpc or http/protobuf, got {protocol!r}")
    return protocol, otlp_endpoint


def _otlp_exporter(protocol: str, endpoint: str | None) -> Any:
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        if endpoint and "://" not in endpoint:
            endpoint = f"http://{endpoint}"  # host:port → plaintext, like a local collector
        return OTLPSpanExporter(endpoint=endpoint)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

    if endpoint:
        if "://" not in endpoint:
            endpoint = f"http://{endpoint}"
        if not endpoint.rstrip("/").endswith("/v1/traces"):
            endpoint = endpoint.rstrip("/") + "/v1/traces"
    return HttpExporter(endpoint=endpoint)


def configure_tracing(
    service_name: str,
    trace_file: str | Path | None = None,
    otlp_endpoint: str | None = None,
    *,
    protocol: str | None = None,
    role: str | None = None,
    schedule_delay_ms: float | None = None,
) -> Tracing | None:
    """A tracer provider exporting to a JSON-lines file and/or OTLP; None when tracing is off.

    Off (None) when OTEL_SDK_DISABLED is true, or when there is neither a trace file nor an
    OTLP destination (see otlp_settings; OTEL_TRACES_EXPORTER=none turns OTLP off, an explicit
    trace file is still written). OTEL_SERVICE_NAME overrides `service_name`;
    OTEL_RESOURCE_ATTRIBUTES, OTEL_BSP_* and the OTLP exporters' own OTEL_EXPORTER_OTLP_*
    settings (headers, timeout, …) apply as usual. `console` in OTEL_TRACES_EXPORTER adds the
    SDK's console exporter. The provider is not made global: pass it (Tracing.*) where needed.
    """
    if _env_flag("OTEL_SDK_DISABLED"):
        return None
    otlp = otlp_settings(otlp_endpoint, protocol)
    console = "console" in _env_list("OTEL_TRACES_EXPORTER")
    if trace_file is None and otlp is None and not console:
        return None
    absent = missing_packages({**TRACING_PACKAGES, **(OTLP_PACKAGES if otlp is not None else {})})
    if absent:
        asked = [what for what, on in (("--trace-file", trace_file is not None),
                                       ("--otlp-endpoint / OTEL_EXPORTER_OTLP_* / OTEL_TRACES_EXPORTER",
                                        otlp is not None),
                                       ("OTEL_TRACES_EXPORTER=console", console)) if on]
        raise TracingUnavailable(f"tracing ({', '.join(asked)}) needs the Python package(s) "
                                 f"{', '.join(absent)}, not installed: pip install {' '.join(absent)}, "
                                 "or run without tracing")

    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    name = os.environ.get("OTEL_SERVICE_NAME") or service_name
    attributes: dict[str, Any] = {"service.name": name, "process.pid": os.getpid()}
    if role:
        attributes["specdec.role"] = role
    provider = TracerProvider(resource=Resource.create(attributes))
    described = []
    if trace_file is not None:
        exporter = JsonLinesSpanExporter(trace_file)
        provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=schedule_delay_ms))
        described.append(f"file:{exporter.path}")
    if otlp is not None:
        proto, endpoint = otlp
        provider.add_span_processor(BatchSpanProcessor(_otlp_exporter(proto, endpoint),
                                                       schedule_delay_millis=schedule_delay_ms))
        described.append(f"otlp-{proto}:{endpoint or '(env/default)'}")
    if console:
        provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
        described.append("console")
    log.info("tracing %s → %s", name, ", ".join(described))
    return Tracing(provider, name, described)


# ============================================================================ JSON-lines sink


def span_to_dict(span: Any) -> dict[str, Any]:
    """An SDK ReadableSpan in the JSON-lines schema shared with the OTLP collector.

    {trace_id, span_id, parent_span_id, name, kind, start_ns, end_ns, status, status_message,
     attributes, events, service, resource, scope}; ids are lowercase hex.
    """
    ctx = span.context
    parent = span.parent
    resource = dict(span.resource.attributes) if span.resource is not None else {}
    status = span.status
    return {
        "trace_id": f"{ctx.trace_id:032x}",
        "span_id": f"{ctx.span_id:016x}",
        "parent_span_id": f"{parent.span_id:016x}" if parent is not None else None,
        "name": span.name,
        "kind": span.kind.name if span.kind is not None else "INTERNAL",
        "start_ns": int(span.start_time or 0),
        "end_ns": int(span.end_time or 0),
        "status": status.status_code.name if status is not None else "UNSET",
        "status_message": (status.description or "") if status is not None else "",
        "attributes": _jsonable(dict(span.attributes or {})),
        "events": [{"name": e.name, "time_ns": int(e.timestamp),
                    "attributes": _jsonable(dict(e.attributes or {}))} for e in span.events],
        "service": str(resource.get("service.name", "")),
        "resource": _jsonable(resource),
        "scope": span.instrumentation_scope.name if span.instrumentation_scope is not None else "",
    }


def _jsonable(attributes: Mapping[str, Any]) -> dict[str, Any]:
    return {str(k): list(v) if isinstance(v, tuple) else v for k, v in attributes.items()}


class JsonLinesSpanExporter:
    """SpanExporter writing one JSON object per span and line (appends; safe for several processes).

    Each batch is one os.write on an O_APPEND descriptor, so processes sharing the file (e.g.
    the three services of `specdec up`) never interleave inside a line.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path).expanduser().resolve()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._lock = threading.Lock()

    def export(self, spans: Sequence[Any]) -> Any:
        from opentelemetry.sdk.trace.export import SpanExportResult

        data = "".join(json.dumps(span_to_dict(s), separators=(",", ":")) + "\n" for s in spans).encode()
        with self._lock:
            if self._fd is None:
                return SpanExportResult.FAILURE
            try:
                view = memoryview(data)
                while view:
                    written = os.write(self._fd, view)
                    view = view[written:]
            except OSError:
                log.exception("could not write spans to %s", self.path)
                return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True

    def shutdown(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


def read_spans(paths: str | Path | Sequence[str | Path]) -> list[dict[str, Any]]:
    """Spans from JSON-lines files (blank and broken lines are skipped), sorted by start time."""
    if isinstance(paths, (str, Path)):
        paths = [paths]
    spans: list[dict[str, Any]] = []
    for path in paths:
        with open(path, encoding="utf-8") as handle:
            for line in handle:
                line = line.strip()
                if not line:
                    continue
                try:
                    span = json.loads(line)
                except json.JSONDecodeError:
                    log.warning("skipping a broken line in %s", path)
                    continue
                if isinstance(span, dict) and "span_id" in span:
                    spans.append(span)
    spans.sort(key=lambda s: (s.get("start_ns", 0), s.get("end_ns", 0)))
    return spans


# ============================================================================ the loop's spans


def _set(span: Any, attributes: Mapping[str, Any]) -> None:
    span.set_attributes({k: v for k, v in attributes.items() if v is not None})


def openai_finish_reason(reason: str) -> str:
    """The OpenAI spelling of a finish reason: eos and stop strings → stop, length → length."""
    return OPENAI_FINISH_REASONS.get(reason, reason)


def genai_request_attributes(request_id: str, model: str, attributes: Mapping[str, Any]) -> dict[str, Any]:
    """GenAI semantic-convention attributes known when a run starts (from the loop's attributes).

    A chat (attributes["chat"] true) is operation "chat", anything else "text_completion".
    top_p / top_k appear when the loop passes them.
    """
    out = {
        "gen_ai.operation.name": "chat" if attributes.get("chat") else "text_completion",
        "gen_ai.provider.name": GENAI_PROVIDER,
        "gen_ai.system": GENAI_PROVIDER,
        "gen_ai.request.model": model,
        "gen_ai.response.model": model,
        "gen_ai.response.id": request_id,
        "gen_ai.request.max_tokens": attributes.get("max_new_tokens"),
        "gen_ai.request.temperature": attributes.get("temperature"),
        "gen_ai.request.top_p": attributes.get("top_p"),
        "gen_ai.request.top_k": attributes.get("top_k"),
        "gen_ai.request.seed": attributes.get("seed"),
        "gen_ai.usage.input_tokens": attributes.get("prompt_tokens"),
    }
    return {k: v for k, v in out.items() if isinstance(v, (str, bool, int, float))}


class LoopTracer:
    """LoopObserver that makes the request / iteration / call spans of the orchestrator loop.

    The request span is a child of whatever is current when the run starts (the gRPC server
    span of Generate, or nothing in-process); it is never attached as the current span (the
    loop is an async generator: attaching across its yields would leak the context into the
    consumer). Each iteration span is attached while the iteration runs, and each call span
    while its call runs, so the gRPC client spans and through them the services' spans nest
    under them. Iteration and call spans start and end at the loop's own readings of the clock
    (the IterationRecord's instants), not at the slightly later moments the hooks run.
    """

    def __init__(self, tracer: Any, model: str = DEFAULT_MODEL) -> None:
        self.tracer = tracer
        self.model = DEFAULT_MODEL
        self.set_model(model)

    def set_model(self, name: str) -> None:
        """The served model name (gen_ai.request.model) of the request spans started from now on."""
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"model: the served model name must be a non-empty string, got {name!r}")
        self.model = name.strip()

    def request_started(self, request_id: str, epoch: Callable[[float], float],
                        attributes: Mapping[str, Any]) -> _RequestSpan:
        from opentelemetry.trace import SpanKind

        span = self.tracer.start_span(REQUEST_SPAN, kind=SpanKind.INTERNAL)
        _set(span, {"specdec.request_id": request_id,
                    **{f"specdec.{k}": _attr(v) for k, v in attributes.items()},
                    **genai_request_attributes(request_id, self.model, attributes)})
        return _RequestSpan(self.tracer, span, epoch, int(attributes.get("resumed_tokens", 0) or 0))


def _attr(value: Any) -> Any:
    if isinstance(value, (str, bool, int, float)) or value is None:
        return value
    if isinstance(value, (list, tuple)) and all(isinstance(v, (str, bool, int, float)) for v in value):
        return list(value)
    return json.dumps(value, default=str)


def _error_status(span: Any, error: BaseException) -> None:
    from opentelemetry.trace import Status, StatusCode

    span.record_exception(error)
    span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))


class _RequestSpan:
    def __init__(self, tracer: Any, span: Any, epoch: Callable[[float], float],
                 output_tokens: int = 0) -> None:
        from opentelemetry import trace as otel_trace

        self.tracer = tracer
        self.span = span
        self.epoch = epoch
        self.context = otel_trace.set_span_in_context(span)
        self.output_tokens = output_tokens  # the request's tokens so far (a resumed run starts with some)

    @contextmanager
    def iteration(self, index: int, start: float) -> Iterator[_IterationSpan]:
        from opentelemetry import trace as otel_trace
        from opentelemetry.trace import SpanKind

        span = self.tracer.start_span(ITERATION_SPAN, context=self.context, kind=SpanKind.INTERNAL,
                                      attributes={"specdec.iteration": index},
                                      start_time=_ns(self.epoch(start)))
        probe = _IterationSpan(self.tracer, span, self.epoch, self)
        try:
            with otel_trace.use_span(span, end_on_exit=False, record_exception=False,
                                     set_status_on_exception=False):
                yield probe
        except BaseException as exc:
            _error_status(span, exc)
            raise
        finally:
            span.end(end_time=probe.end_ns)

    def finished(self, result: GenerationResult | None, error: BaseException | None) -> None:
        span = self.span
        if result is not None:
            stats = result.stats
            _set(span, {
                "specdec.finish_reason": result.finish_reason,
                "specdec.iterations": stats.iterations,
                "specdec.drafted_iterations": stats.drafted_iterations,
                "specdec.new_tokens": stats.new_tokens,
                "specdec.drafted_tokens": stats.drafted_tokens,
                "specdec.accepted_tokens": stats.accepted_tokens,
                "specdec.acceptance_rate": stats.acceptance_rate,
                "specdec.tokens_per_second": stats.tokens_per_second,
                "specdec.draft_seconds": stats.draft_seconds,
                "specdec.verify_seconds": stats.verify_seconds,
                "specdec.overlap_seconds": stats.overlap_seconds,
                "specdec.fallback_iterations": stats.fallback_iterations,
                "gen_ai.response.finish_reasons": [openai_finish_reason(result.finish_reason)],
                "gen_ai.usage.input_tokens": result.prompt_tokens,
            })
            self.output_tokens = len(result.token_ids)
        span.set_attribute("gen_ai.usage.output_tokens", self.output_tokens)
        if error is not None:
            _error_status(span, error)
        elif result is None:
            span.set_attribute("specdec.finish_reason", "abandoned")
        span.end()


def _ns(epoch_seconds: float) -> int:
    return int(round(epoch_seconds * 1e9))


class _IterationSpan:
    def __init__(self, tracer: Any, span: Any, epoch: Callable[[float], float],
                 request: _RequestSpan) -> None:
        self.tracer = tracer
        self.span = span
        self.epoch = epoch
        self.request = request
        self.end_ns: int | None = None

    def call_started(self, kind: str, op: str, start: float) -> tuple[Any, Any]:
        # A child of the current span: this iteration's (calls run inside iteration()).
        from opentelemetry import context as otel_context
        from opentelemetry import trace as otel_trace
        from opentelemetry.trace import SpanKind

        span = self.tracer.start_span(CALL_SPANS.get(kind, f"specdec.{kind}"), kind=SpanKind.INTERNAL,
                                      attributes={"specdec.call": op}, start_time=_ns(self.epoch(start)))
        token = otel_context.attach(otel_trace.set_span_in_context(span))
        return span, token

    def call_finished(self, token: tuple[Any, Any], end: float, error: BaseException | None) -> None:
        from opentelemetry import context as otel_context

        span, context_token = token
        otel_context.detach(context_token)
        if error is not None:
            _error_status(span, error)
        span.end(end_time=_ns(self.epoch(end)))

    def finished(self, record: IterationRecord, depth: int) -> None:
        draft_s = sum(e - s for s, e in record.draft_intervals)
        verify_s = sum(e - s for s, e in record.verify_intervals)
        _set(self.span, {
            "specdec.iteration": record.index,
            "specdec.request_id": record.request_id,
            "specdec.position": record.position,
            "specdec.method": record.method,
            # where the draft came from; a drafted record without one is the draft model's (as the
            # statistics count it); absent when nothing was drafted
            "specdec.source": record.source or (DraftSource.MODEL if record.drafted else None),
            "specdec.a": record.a,
            "specdec.k": record.k,
            "specdec.heads": record.heads,
            "specdec.drafted": record.drafted,
            "specdec.num_drafted": record.num_drafted,
            "specdec.depth": depth,
            "specdec.accepted": record.accepted,
            "specdec.emitted": len(record.emitted),  # a count: generated content stays out of traces
            "specdec.fallback": record.fallback,
            "specdec.draft_seconds": draft_s,
            "specdec.verify_seconds": verify_s,
            "specdec.overlap_seconds": record.overlap_seconds,
            "specdec.overlap_share": record.overlap_seconds / verify_s if verify_s > 0 else 0.0,
        })
        self.end_ns = _ns(record.end) if record.end else None
        self.request.output_tokens += len(record.emitted)


# ============================================================================ the services' spans


class EngineSpans:
    """ServiceObserver: spans of the engine work under the gRPC server span of each call.

    `observe` runs on the event loop right after the engine call returned, while the server
    span (the caller's trace, from the metadata) is current. The engine-call span has the
    real start/end of the call in its worker thread; its children come from the timings the
    engine returns (forward_seconds, verify_seconds): measured durations, derived placement.
    """

    def __init__(self, tracer: Any, role: str) -> None:
        self.tracer = tracer
        self.role = role

    def observe(self, rpc: str, request: Any, result: Any, error: BaseException | None,
                start_ns: int, end_ns: int) -> None:
        if rpc not in ("Draft", "Lookahead", "Score", "Verify"):
            return
        from opentelemetry import trace as otel_trace
        from opentelemetry.trace import SpanKind

        name = f"{self.role}.{rpc.lower()}"
        span = self.tracer.start_span(name, kind=SpanKind.INTERNAL, start_time=start_ns,
                                      attributes=_request_attributes(request))
        ctx = otel_trace.set_span_in_context(span)
        if error is not None:
            _error_status(span, error)
        elif result is None:
            pass  # Score returns nothing: the call span is the forward pass
        elif rpc in ("Draft", "Lookahead"):
            self._draft(span, ctx, result, end_ns)
        elif rpc == "Verify":
            self._verify(span, ctx, result, start_ns, end_ns)
        span.end(end_time=end_ns)

    def _child(self, name: str, ctx: Any, start_ns: int, end_ns: int, attributes: Mapping[str, Any]) -> None:
        child = self.tracer.start_span(name, context=ctx, start_time=start_ns,
                                       attributes={"specdec.derived": True, **attributes})
        child.end(end_time=max(start_ns, end_ns))

    def _draft(self, span: Any, ctx: Any, result: Any, end_ns: int) -> None:
        branches = getattr(result, "branches", None)  # a Lookahead: one drafted sequence per guess
        attributes = {"specdec.reused_tokens": result.reused_tokens,
                      "specdec.forward_seconds": result.forward_seconds}
        if branches is None:
            attributes["specdec.draft_tokens"] = len(result.tokens)
        else:
            attributes["specdec.draft_tokens"] = sum(len(b.draft.tokens) for b in branches)
            attributes["specdec.guesses"] = len(branches)
        _set(span, attributes)
        forward_ns = int(result.forward_seconds * 1e9)
        if forward_ns > 0:
            # The passes are spread over the call (sampling in between); shown as one block.
            start = max(span.start_time, end_ns - forward_ns)
            self._child(f"{self.role}.forward", ctx, start, start + forward_ns,
                        {"specdec.reused_tokens": result.reused_tokens})

    def _verify(self, span: Any, ctx: Any, result: Any, start_ns: int, end_ns: int) -> None:
        score_reused = bool(result.score_reused)
        _set(span, {"specdec.accepted": len(result.accepted_nodes), "specdec.emitted": len(result.tokens),
                    "specdec.num_drafted": result.num_drafted, "specdec.reused_tokens": result.reused_tokens,
                    "specdec.forward_seconds": result.forward_seconds,
                    "specdec.verification_seconds": result.verify_seconds,
                    "specdec.score_reused": score_reused,
                    "specdec.pending_tokens": int(result.pending_tokens),
                    "specdec.draft_rows_needed": len(result.draft_rows_needed)})
        verify_ns = int(result.verify_seconds * 1e9)
        verification_start = max(start_ns, end_ns - verify_ns)
        if not score_reused and result.forward_seconds > 0:
            forward_start = max(start_ns, verification_start - int(result.forward_seconds * 1e9))
            self._child(f"{self.role}.forward", ctx, forward_start, verification_start,
                        {"specdec.reused_tokens": result.reused_tokens})
        self._child(f"{self.role}.verification", ctx, verification_start, verification_start + verify_ns,
                    {"specdec.accepted": len(result.accepted_nodes)})


def _request_attributes(request: Any) -> dict[str, Any]:
    attributes: dict[str, Any] = {}
    for name in ("session_id", "base_len", "strategy", "method"):
        value = getattr(request, name, None)
        if value is not None:
            attributes[f"specdec.{name}"] = value
    append = getattr(request, "append", None)
    if append is not None:
        attributes["specdec.append_tokens"] = len(append)
    for name in ("shape_parents", "tree_tokens"):
        value = getattr(request, name, None)
        if value is not None:
            attributes["specdec.tree_size"] = len(value)
    return attributes


__all__ = [
    "LoopObserver", "RequestProbe", "IterationProbe", "ServiceObserver", "combine_observers",
    "Tracing", "configure_tracing", "otlp_settings", "JsonLinesSpanExporter", "span_to_dict", "read_spans",
    "LoopTracer", "EngineSpans", "genai_request_attributes", "openai_finish_reason",
]

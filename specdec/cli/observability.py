"""CLI pieces of observability: options for `serve *`, `up`, `generate`, their set-up, and the
`trace-report` / `trace-collect` commands (mounted on the `specdec` app by specdec.cli.main).

Heavy imports (opentelemetry SDK, prometheus-client, grpc) happen inside the functions so that
`specdec --help` stays fast.
"""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import typer

from specdec.cli.commands import SpecdecCommand, SpecdecGroup
from specdec.cli.common import CliError, fail

log = logging.getLogger(__name__)

ROLES = ("orchestrator", "drafter", "verifier", "generate")
SERVICE_NAMES = {role: f"specdec-{role}" for role in ROLES}
# `up --metrics-port P`: orchestrator on P, drafter on P+1, verifier on P+2 (0: any free port each).
METRICS_PORT_OFFSETS = {"orchestrator": 0, "drafter": 1, "verifier": 2}

TraceFileOpt = Annotated[Path | None, typer.Option(
    "--trace-file", help="Append every span (OpenTelemetry) to this JSON-lines file; `specdec trace-report "
    "FILE` turns it into a timeline. Several processes may share one file.", show_default=False)]
OtlpEndpointOpt = Annotated[str | None, typer.Option(
    "--otlp-endpoint", help="Export spans over OTLP to this endpoint (grpc: host:4317; http/protobuf with "
    "OTEL_EXPORTER_OTLP_PROTOCOL). Default: $OTEL_EXPORTER_OTLP_ENDPOINT, else no OTLP export.",
    show_default=False)]
MetricsPortOpt = Annotated[int | None, typer.Option(
    "--metrics-port", help="Serve Prometheus metrics on http://HOST:PORT/metrics (0 = any free port). "
    "Default: no metrics endpoint.", show_default=False)]
MetricsHostOpt = Annotated[str, typer.Option(
    "--metrics-host", help="Interface of the /metrics endpoint.")]
MetricsTokenFileOpt = Annotated[Path | None, typer.Option(
    "--metrics-token-file", help="/metrics answers 401 unless the scraper sends `Authorization: Bearer "
    "<token>` with the token in this file (one line of printable ASCII; Prometheus: authorization.credentials"
    "_file). Default: the service's --auth-token-file when it has one (unless --open-metrics), else no "
    "token (fine on a loopback --metrics-host).", show_default=False)]
OpenMetricsOpt = Annotated[bool, typer.Option(
    "--open-metrics", help="Serve /metrics without a token even though the service's port requires one "
    "(--auth-token-file): e.g. for a scraper inside a network policy. Default: a service with a token "
    "asks the scraper for it on /metrics too.")]
MetricsTlsOpt = Annotated[bool, typer.Option(
    "--metrics-tls", help="Serve /metrics over HTTPS with the service's --tls-cert and --tls-key (needs "
    "them). Default: plain HTTP.")]


@dataclass
class Observability:
    """Tracing and metrics of one process, ready to be handed to servers, clients and the loop."""

    role: str
    tracing: Any = None  # orchestrator.tracing.Tracing | None
    registry: Any = None  # prometheus_client.CollectorRegistry | None
    metrics_server: Any = None  # orchestrator.metrics.MetricsServer | None
    _orchestrator_metrics: Any = None
    _engine_metrics: Any = None
    # For start_http_server(metrics=...): the HTTP API's requests on /metrics (None when off).
    http_metrics: Any = None  # orchestrator.metrics.HttpMetrics | None
    _closed: bool = field(default=False, repr=False)

    @property
    def metrics_port(self) -> int | None:
        return self.metrics_server.port if self.metrics_server is not None else None

    @property
    def server_interceptors(self) -> list[Any]:
        """For start_*_server(interceptors=...): continue callers' traces (empty when tracing is off)."""
        return self.tracing.server_interceptors() if self.tracing is not None else []

    @property
    def client_interceptors(self) -> list[Any]:
        """For Grpc*Client(interceptors=...): send the trace context (empty when tracing is off)."""
        return self.tracing.client_interceptors() if self.tracing is not None else []

    @property
    def service_observers(self) -> list[Any]:
        """For start_drafter_server / start_verifier_server(observers=...)."""
        observers = []
        if self.tracing is not None:
            observers.append(self.tracing.service_observer(self.role))
        if self._engine_metrics is not None:
            observers.append(self._engine_metrics.observer(self.role))
        return observers

    @property
    def loop_observer(self) -> Any:
        """For Orchestrator(observer=...): request / iteration / call spans and metrics (None when off)."""
        from orchestrator.tracing import combine_observers

        return combine_observers(self.tracing.loop_observer() if self.tracing is not None else None,
                                 self._orchestrator_metrics)

    def watch_orchestrator(self, orchestrator: Any) -> None:
        """Expose the orchestrator's request slots (admitted, queued, rejected) on /metrics."""
        if self._orchestrator_metrics is not None:
            self._orchestrator_metrics.watch_orchestrator(orchestrator)

    def set_model(self, name: str) -> None:
        """The served model's name on metrics (`model` label) and spans (gen_ai.request.model)."""
        if self.tracing is not None:
            self.tracing.set_model(name)
        if self._orchestrator_metrics is not None:
            self._orchestrator_metrics.set_model(name)

    def watch_engine(self, engine: Any) -> None:
        """Expose engine.stats() (sessions, evictions) on /metrics."""
        if self._engine_metrics is not None:
            self._engine_metrics.watch_engine(self.role, engine)

    def ready_info(self) -> dict[str, Any]:
        """Extra fields for a ready file."""
        info: dict[str, Any] = {}
        if self.metrics_server is not None:
            info["metrics_port"] = self.metrics_server.port
            info["metrics_url"] = self.metrics_server.url
        if self.tracing is not None:
            info["tracing"] = list(self.tracing.exporters)
        return info

    def shutdown(self) -> None:
        """Flush spans and stop the /metrics server (idempotent; call before the process exits)."""
        if self._closed:
            return
        self._closed = True
        if self.tracing is not None:
            self.tracing.shutdown()
        if self.metrics_server is not None:
            self.metrics_server.close()


def setup_observability(role: str, *, trace_file: Path | str | None = None, otlp_endpoint: str | None = None,
                        metrics_port: int | None = None, metrics_host: str = "127.0.0.1",
                        service_name: str | None = None, metrics_token: str | None = None,
                        metrics_cert: Path | None = None, metrics_key: Path | None = None,
                        protected: bool = False) -> Observability:
    """Tracing (when a trace file or an OTLP endpoint is configured) and metrics (when a port is given).

    role: orchestrator | drafter | verifier | generate (the CLI client / in-process run).
    metrics_token / metrics_cert + metrics_key: /metrics asks for the bearer token / speaks TLS.
    protected: the service's own port uses TLS or tokens; then an open /metrics on a non-loopback
    address is logged as a warning (it tells anyone the load, models and request counts).
    """
    if role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
    from orchestrator.tracing import configure_tracing

    obs = Observability(role)
    obs.tracing = configure_tracing(service_name or SERVICE_NAMES[role], trace_file, otlp_endpoint, role=role)
    if metrics_port is not None:
        from orchestrator import metrics

        obs.registry = metrics.new_registry()
        if role in ("orchestrator", "generate"):
            obs._orchestrator_metrics = metrics.OrchestratorMetrics(obs.registry)
            if role == "orchestrator":  # the HTTP API's requests (specdec serve orchestrator --http-port)
                obs.http_metrics = metrics.HttpMetrics(obs.registry)
        else:
            obs._engine_metrics = metrics.EngineMetrics(obs.registry)
        try:
            if metrics_token is not None or metrics_cert is not None:
                from orchestrator.metrics_endpoint import start_protected_metrics_server

                obs.metrics_server = start_protected_metrics_server(
                    metrics_port, metrics_host, obs.registry, token=metrics_token, certfile=metrics_cert,
                    keyfile=metrics_key)
            else:
                obs.metrics_server = metrics.start_metrics_server(metrics_port, metrics_host, obs.registry)
                warn_open_metrics(role, metrics_host, protected)
        except (OSError, ValueError) as exc:
            obs.shutdown()
            raise OSError(f"could not serve metrics on {metrics_host}:{metrics_port}: {exc}") from None
    return obs


def warn_open_metrics(role: str, host: str, protected: bool) -> str | None:
    """Log (WARNING) and return the line for a /metrics without token or TLS on a non-loopback
    address of a service whose own port is protected; None when there is nothing to say."""
    from specdec.rpc.security import is_loopback

    if not protected or is_loopback(host):
        return None
    message = (f"{role}: /metrics on {host} (not a loopback address) has no token and no TLS while the "
               "service port has them: anyone who reaches it reads the load, models and request counts; "
               "add --metrics-token-file (and --metrics-tls), or bind --metrics-host 127.0.0.1")
    log.warning(message)
    return message


def child_args(role: str, *, trace_file: Path | str | None = None, otlp_endpoint: str | None = None,
               metrics_port: int | None = None, metrics_host: str | None = None,
               metrics_token_file: Path | None = None, metrics_tls: bool = False) -> list[str]:
    """The observability options `up` passes to its `serve ROLE` child (all children share one trace file)."""
    args: list[str] = []
    if trace_file is not None:
        args += ["--trace-file", str(Path(trace_file).expanduser().resolve())]
    if otlp_endpoint is not None:
        args += ["--otlp-endpoint", otlp_endpoint]
    if metrics_port is not None:
        port = metrics_port + METRICS_PORT_OFFSETS[role] if metrics_port else 0
        args += ["--metrics-port", str(port)]
        if metrics_host is not None:
            args += ["--metrics-host", metrics_host]
        if metrics_token_file is not None:
            args += ["--metrics-token-file", str(Path(metrics_token_file).expanduser().resolve())]
        else:  # `up`'s own /metrics is open: its children's are too (theirs would take the engine token)
            args.append("--open-metrics")
        if metrics_tls:
            args.append("--metrics-tls")
    return args


@dataclass
class ObservabilityOptions:
    """--trace-file / --otlp-endpoint / --metrics-port / --metrics-host / --metrics-token-file /
    --metrics-tls as given on the command line; `tls_cert` / `tls_key`: the service's, for --metrics-tls.
    Built before anything loads: a bad token file exits 1, --metrics-tls without --tls-cert exits 2."""

    trace_file: Path | None = None
    otlp_endpoint: str | None = None
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    metrics_token_file: Path | None = None
    metrics_tls: bool = False
    tls_cert: Path | None = None
    tls_key: Path | None = None
    # The service's own token (--auth-token-file): /metrics asks for it too, unless --open-metrics.
    auth_token_file: Path | None = None
    open_metrics: bool = False
    metrics_token: str | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.metrics_token_file is None and self.auth_token_file is not None and not self.open_metrics:
            self.metrics_token_file = self.auth_token_file
        if self.metrics_tls and (self.tls_cert is None or self.tls_key is None):
            raise fail("--metrics-tls serves /metrics with the service's certificate: it needs --tls-cert "
                       "and --tls-key", 2)
        if self.metrics_token_file is not None:
            from specdec.rpc.security import read_token_file

            try:
                self.metrics_token = read_token_file(self.metrics_token_file, "--metrics-token-file")
            except ValueError as exc:
                raise fail(str(exc)) from None

    def setup(self, role: str, protected: bool = False) -> Observability:
        """Tracing and metrics of this process (setup_observability); CliError when it fails, a usage
        error (exit 2) when tracing is asked for without the OpenTelemetry packages."""
        from orchestrator.tracing import TracingUnavailable
        from specdec.cli import extras

        if self.metrics_port is not None:
            extras.require(extras.METRICS, "--metrics-port", "leave --metrics-port out")
        try:
            return setup_observability(role, trace_file=self.trace_file, otlp_endpoint=self.otlp_endpoint,
                                       metrics_port=self.metrics_port, metrics_host=self.metrics_host,
                                       metrics_token=self.metrics_token,
                                       metrics_cert=self.tls_cert if self.metrics_tls else None,
                                       metrics_key=self.tls_key if self.metrics_tls else None,
                                       protected=protected)
        except TracingUnavailable as exc:
            raise fail(f"{role}: {exc}", 2) from None
        except (OSError, ValueError) as exc:
            raise CliError(f"{role}: {exc}") from None

    def child_args(self, role: str) -> list[str]:
        """What `up` passes on to its `serve ROLE` child (metrics ports: orchestrator P, drafter P+1, …)."""
        return child_args(role, trace_file=self.trace_file, otlp_endpoint=self.otlp_endpoint,
                          metrics_port=self.metrics_port, metrics_host=self.metrics_host,
                          metrics_token_file=self.metrics_token_file, metrics_tls=self.metrics_tls)


# ============================================================================ commands


def trace_report(
    paths: Annotated[list[Path], typer.Argument(
        help="Span files: JSON lines from --trace-file or `specdec trace-collect`, or an OpenTelemetry "
        "Collector file-exporter file (OTLP/JSON); the format is told line by line.", show_default=False)],
    out: Annotated[Path, typer.Option("--out", "-o", help="The HTML page to write.")] = Path("timeline.html"),
    chrome: Annotated[Path | None, typer.Option(
        "--chrome", help="Also write Chrome/Perfetto trace-event JSON here (open in ui.perfetto.dev).",
        show_default=False)] = None,
    screenshot: Annotated[Path | None, typer.Option(
        "--screenshot", help="Also save a PNG of the page (needs Chromium: apt-get install chromium).",
        show_default=False)] = None,
    title: Annotated[str, typer.Option("--title", help="Title of the page.")] = "specdec timeline",
    max_requests: Annotated[int, typer.Option(
        "--max-requests", help="Draw at most this many requests (all count in the summary).")] = 50,
) -> None:
    """Turn the spans of a run into a self-contained HTML timeline: draft vs verify per iteration,
    accepted tokens, overlap; optionally Chrome/Perfetto JSON and a screenshot."""
    from specdec.cli import trace_report as report
    from specdec.cli.span_files import SpanFileError, load_spans

    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        typer.echo(f"error: no such file: {', '.join(missing)}", err=True)
        raise typer.Exit(1)
    try:
        spans = load_spans(paths)
    except SpanFileError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    page = report.render_html(spans, title=title, sources=[p.name for p in paths], max_requests=max_requests)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(page, encoding="utf-8")
    summary = report.summarize(report.build_runs(spans))
    typer.echo(f"{out}: {summary.requests} requests, {summary.iterations} iterations, {len(spans)} spans, "
               f"overlap share {100 * summary.overlap_share:.0f}%", err=True)
    if chrome is not None:
        report.write_chrome_trace(spans, chrome)
        typer.echo(f"{chrome}: Chrome/Perfetto trace", err=True)
    if screenshot is not None:
        try:
            report.screenshot(out, screenshot)
        except (RuntimeError, TimeoutError) as exc:
            typer.echo(f"error: screenshot: {exc}", err=True)
            raise typer.Exit(1) from None
        typer.echo(f"{screenshot}: screenshot", err=True)


def trace_collect(
    port: Annotated[int, typer.Option("--port", help="Port of the OTLP/gRPC receiver (0 = any free port).")]
        = 4317,
    out: Annotated[Path, typer.Option("--out", "-o", help="Append received spans to this JSON-lines file.")]
        = Path("spans.jsonl"),
    host: Annotated[str, typer.Option("--host", help="Interface to listen on.")] = "127.0.0.1",
    duration: Annotated[float | None, typer.Option(
        "--duration", help="Stop after this many seconds. Default: until Ctrl-C / SIGTERM.",
        show_default=False)] = None,
    max_spans: Annotated[int | None, typer.Option(
        "--max-spans", help="Stop once this many spans were received.", show_default=False)] = None,
    ready_file: Annotated[Path | None, typer.Option(
        "--ready-file", help="Once listening, write JSON {address, port, pid} to this file.",
        show_default=False)] = None,
) -> None:
    """Receive spans over OTLP/gRPC (point OTEL_EXPORTER_OTLP_ENDPOINT or --otlp-endpoint at it) and
    write them as JSON lines for `specdec trace-report`."""
    from specdec.cli import extras

    extras.require(extras.OTLP_RECEIVER, "trace-collect", "run an OpenTelemetry Collector instead")
    from specdec.cli.trace_collector import run_collector

    def ready(bound: int) -> None:
        typer.echo(f"collecting OTLP spans on {host}:{bound} → {out}", err=True)
        if ready_file is not None:
            from specdec.cli.processes import write_ready_file

            write_ready_file(ready_file, {"address": f"{host}:{bound}", "host": host, "port": bound,
                                         "pid": os.getpid(), "out": str(out)})

    try:
        collector = asyncio.run(run_collector(host, port, out, duration_s=duration, max_spans=max_spans,
                                              ready=ready))
    except OSError as exc:
        typer.echo(f"error: trace-collect: {exc}", err=True)
        raise typer.Exit(1) from None
    finally:
        if ready_file is not None:
            ready_file.unlink(missing_ok=True)
    typer.echo(f"received {len(collector.spans)} spans in {collector.requests} exports", err=True)


def register_commands(app: typer.Typer) -> None:
    """Mount `trace-report` and `trace-collect` on the `specdec` app."""
    app.command("trace-report", cls=SpecdecCommand)(trace_report)
    app.command("trace-collect", cls=SpecdecCommand)(trace_collect)


trace_app = typer.Typer(cls=SpecdecGroup, help="Observability commands (trace-report, trace-collect).",
                        no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)
register_commands(trace_app)

if __name__ == "__main__":  # python -m specdec.cli.observability trace-report …
    trace_app()

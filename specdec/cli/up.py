"""`specdec up`: drafter, verifier and orchestrator as three supervised processes on this machine.

Each child is `python -m specdec.cli serve ROLE ...` (specdec.cli.processes starts, pins,
health-waits, watches, restarts and stops them); this module turns the options into their arguments
and restart policies, and supervisor events into console lines.
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table

from specdec.cli import processes
from specdec.cli.common import CliError, err, fail, resolve_model
from specdec.cli.option_groups import (
    CudaGraphs,
    EngineBatching,
    EngineCapacity,
    OrchestratorLimits,
    RequestDefaults,
    ServerTls,
    Telemetry,
    takes_option_groups,
)
from specdec.cli.options import (
    UP_CPU_DRAFT_MODEL_MAX_REQUESTS,
    AuthTokenFileOpt,
    ChatTemplateOpt,
    DtypeOpt,
    ServedModelNameOpt,
    TenantsFileOpt,
    TlsClientKeyOpt,
    TlsServerNameOpt,
    absolute_path,
    check_device,
    check_port_free,
    client_security,
    one_of,
    parse_cores,
    precision_line,
)
from specdec.cli.processes import (
    DEFAULT_DRAFTER_PORT,
    DEFAULT_HOST,
    DEFAULT_HTTP_PORT,
    DEFAULT_ORCHESTRATOR_ADDRESS,
    DEFAULT_ORCHESTRATOR_PORT,
    DEFAULT_VERIFIER_PORT,
    ProcessError,
)
from specdec.cli.serve import NO_DRAFTER, WITHOUT_DRAFTER, is_no_drafter
from specdec.defaults import (
    AUTO_PRECISION,
    DEFAULT_DRAFT_MODEL,
    DEFAULT_DRAFT_SOURCE,
    DEFAULT_TARGET_MODEL,
    DRAFT_SOURCES,
    DraftSource,
)

LOCAL_DRAFTER = "local"
DRAFT_SOURCE_ENV = "SPECDEC_DRAFT_SOURCE"  # the orchestrator's own variable (OrchestratorConfig.draft_source)


@dataclass(frozen=True)
class UpTelemetry(Telemetry):
    """`up`'s --metrics-port numbers three endpoints, one per service."""

    metrics_port: Annotated[int | None, typer.Option(
        "--metrics-port", help="Prometheus /metrics of the orchestrator on this port, the drafter on +1, the "
        "verifier on +2 (0 = any free ports). Default: no metrics endpoints.", show_default=False)] = None


def up_draft_model_max_requests(given: int | None, drafter_device: str, verifier_device: str) -> int | None:
    """The orchestrator's --draft-model-max-requests under `up`: the flag, else (when
    $SPECDEC_DRAFT_MODEL_MAX_REQUESTS is unset) UP_CPU_DRAFT_MODEL_MAX_REQUESTS where both models share
    the CPU; None leaves it to the orchestrator's own default."""
    if given is not None or os.environ.get("SPECDEC_DRAFT_MODEL_MAX_REQUESTS"):
        return given
    return UP_CPU_DRAFT_MODEL_MAX_REQUESTS if drafter_device == verifier_device == "cpu" else None


def up_close_chat_turns(given: bool | None, prefix_cache_mb: float) -> str | None:
    """The orchestrator's chat-turn flag under `up`: off without a prefix cache (the close would be
    computed for nothing), else the flag given; None leaves it to the orchestrator's default."""
    if prefix_cache_mb <= 0:
        return "--no-close-chat-turns"
    if given is None:
        return None
    return "--close-chat-turns" if given else "--no-close-chat-turns"


@takes_option_groups
def up(
    *,
    draft: Annotated[str, typer.Option("--draft", help=(
        "Draft model: registry name or path; none: no draft model (the same as --drafter none)."))] =
        DEFAULT_DRAFT_MODEL,
    drafter: Annotated[str, typer.Option(
        "--drafter", callback=one_of((LOCAL_DRAFTER, NO_DRAFTER)), rich_help_panel="Models and placement",
        help=("local: start a drafter process serving --draft. none: no draft model is loaded and no drafter "
              "process starts; the verifier gets every core that drafter and verifier would have shared "
              "(--verifier-cores defaults to all available cores, --verifier-threads to their number), and "
              "the orchestrator drafts model-free (--draft-source hybrid, lookup or suffix) or takes "
              "target-only steps. With none, --draft-source model, a --draft model, --drafter-cores, "
              "--drafter-threads and --drafter-device are usage errors; --drafter-port and "
              "--drafter-restarts are unused."))] = LOCAL_DRAFTER,
    target: Annotated[str, typer.Option("--target", help="Target model: registry name or path.")] =
        DEFAULT_TARGET_MODEL,
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
        "--verifier-cores", help="Cores of the verifier. Default: the other available cores (all of "
        "them with --drafter none).",
        show_default=False)] = None,
    no_pin: Annotated[bool, typer.Option("--no-pin", help="Do not pin drafter and verifier to cores.")] =
        False,
    verifier_shares_cores: Annotated[bool, typer.Option(
        "--verifier-shares-cores/--verifier-own-cores", help="CPU, pinned: the verifier is pinned to the "
        "drafter's cores too and runs every pass on all of them; with --verifier-threads N, a pass "
        "beside a drafter call runs N threads instead (serve --threads-beside-drafter). "
        "--verifier-own-cores keeps it on its own cores always.")] = True,
    drafter_device: Annotated[str, typer.Option(
        "--drafter-device", callback=check_device, help="torch device of the draft model: cpu, cuda, cuda:N "
        "or mps.")] = "cpu",
    verifier_device: Annotated[str, typer.Option(
        "--verifier-device", callback=check_device, help="torch device of the target model.")] = "cpu",
    dtype: DtypeOpt = AUTO_PRECISION,
    drafter_threads: Annotated[int | None, typer.Option(
        "--drafter-threads", help="torch threads of the drafter. Default: its number of cores.",
        show_default=False)] = None,
    verifier_threads: Annotated[int | None, typer.Option(
        "--verifier-threads", help="torch threads of the verifier (with --verifier-shares-cores: of its "
        "passes beside a drafter call). Default: its number of cores.",
        show_default=False)] = None,
    capacity: EngineCapacity,
    batch: EngineBatching,
    graphs: CudaGraphs,
    defaults: RequestDefaults,
    store_url: Annotated[str | None, typer.Option(
        "--store-url", help="redis://host:port/db for the orchestrator's store. Default: in memory.",
        show_default=False)] = None,
    limits: OrchestratorLimits,
    http_port: Annotated[int, typer.Option(
        "--http-port", min=0, max=65535, help="Port of the orchestrator's OpenAI-compatible HTTP API "
        "(/v1/completions, /v1/chat/completions, /v1/models, /health; docs/http.md), on --host with "
        "the same TLS and token as its gRPC port (0 = any free port).")] = DEFAULT_HTTP_PORT,
    no_http: Annotated[bool, typer.Option("--no-http", help="Serve no HTTP API (gRPC only).")] = False,
    served_model_name: ServedModelNameOpt = None,
    chat_template: ChatTemplateOpt = None,
    startup_timeout: Annotated[float, typer.Option(
        "--startup-timeout", help="Seconds each service may take to load and pass its health check.")] =
        600.0,
    drafter_restarts: Annotated[int | None, typer.Option(
        "--drafter-restarts", min=0, show_default="unlimited", help="Restart a drafter that dies at most "
        "this many times in all (each after a back-off from 0.5 s doubling to 30 s, reset after 60 s of "
        "healthy running); past that it stays down and the orchestrator goes on target-only (exact, "
        "slower) for good, as it does while the drafter restarts. 0 = never restart it.")] = None,
    restarts: Annotated[int | None, typer.Option(
        "--restarts", min=0, show_default="unlimited", help="Restart the verifier or the orchestrator when "
        "it dies at most this many times each (same back-off, same ports: clients reconnect; requests "
        "in flight fail UNAVAILABLE and can Resume); past that `up` stops everything and exits 1.")] = None,
    ready_file: Annotated[Path | None, typer.Option(
        "--ready-file", help="Once all three are healthy, write JSON {orchestrator, drafter, verifier, pids, "
        "restarts, log_dir, pid} to this file (drafter null with --drafter none); rewritten with the new pid "
        "after each restart (a service left down has none); removed on shutdown.",
        show_default=False)] = None,
    log_dir: Annotated[Path | None, typer.Option(
        "--log-dir", help="Folder for the services' logs. Default: a new temporary folder.",
        show_default=False)] = None,
    telemetry: UpTelemetry,
    tls: ServerTls,
    tls_ca: Annotated[Path | None, typer.Option(
        "--tls-ca", help="The PEM CA certificate that signed --tls-cert (needed with it): the orchestrator "
        "verifies the drafter and the verifier with it, and `up` its health checks of all three.",
        show_default=False)] = None,
    tls_client_cert: Annotated[Path | None, typer.Option(
        "--tls-client-cert", help="mTLS: the client certificate (signed by --tls-client-ca) that the "
        "orchestrator presents to the drafter and the verifier, and `up` to all three for its health "
        "checks; needed with --tls-require-client-cert.", show_default=False)] = None,
    tls_client_key: TlsClientKeyOpt = None,
    tls_server_name: TlsServerNameOpt = None,
    auth_token_file: AuthTokenFileOpt = None,
    tenants_file: TenantsFileOpt = None,
) -> None:
    """Start drafter, verifier and orchestrator as three processes on this machine; stop them on Ctrl-C.

    Drafter and verifier are pinned to different cores; each service must pass its gRPC health
    check before the next step. `up` then supervises them until Ctrl-C / SIGTERM (exit 0): a
    service that dies is restarted on its ports after a back-off (0.5 s doubling to 30 s), each
    death and restart logged here. While the drafter is away the orchestrator goes on target-only
    (exact, slower), for good past --drafter-restarts; while the verifier is away requests get
    UNAVAILABLE. `up` exits 1 only when a service cannot start at all, or when the verifier or the
    orchestrator dies more than --restarts times.

    --drafter none (or --draft none) starts no drafter and loads no draft model: the verifier gets
    all the cores, and the orchestrator drafts model-free (--draft-source hybrid, lookup or suffix)
    or takes target-only steps.

    The --tls-* options apply to all three services (docs/security.md); --auth-token-file guards
    the orchestrator. The drafter and the verifier always get a fresh random token that only the
    orchestrator knows, so no client can call them directly.
    """
    # Usage errors first (exit 2), then what is missing here (models), then the ports: a bad
    # option is reported as such even while another `up` holds the default ports.
    no_drafter = drafter == NO_DRAFTER or is_no_drafter(draft)
    draft_source = defaults.draft_source
    _check_drafter_options(no_drafter, draft=draft, draft_source=draft_source, drafter_cores=drafter_cores,
                           drafter_threads=drafter_threads, drafter_device=drafter_device)
    tls_args, orchestrator_args, probe = _security_args(
        tls, tls_ca=tls_ca, tls_client_cert=tls_client_cert, tls_client_key=tls_client_key,
        tls_server_name=tls_server_name, auth_token_file=auth_token_file, tenants_file=tenants_file)
    d_cores = v_cores = None
    if no_drafter:  # the verifier gets every core (and as many threads) that the two would have shared
        if not no_pin:
            v_cores = parse_cores(verifier_cores, "--verifier-cores") or processes.available_cores()
        if verifier_threads is None:
            verifier_threads = len(v_cores or processes.available_cores())
    elif not no_pin:
        d_default, v_default = processes.default_core_split()
        d_cores = parse_cores(drafter_cores, "--drafter-cores") or d_default
        v_cores = parse_cores(verifier_cores, "--verifier-cores") or v_default
    beside_drafter = None  # the verifier's threads while a drafter call runs beside its pass
    if (verifier_shares_cores and not no_drafter and d_cores is not None and v_cores is not None
            and drafter_device == verifier_device == "cpu"):
        v_cores, verifier_threads, beside_drafter = shared_core_widths(v_cores, d_cores, verifier_threads)
    # Ports first: a busy port is found in milliseconds, before models are looked up (or converted).
    ports = [("--port", port), ("--verifier-port", verifier_port)]
    if not no_drafter:
        ports.insert(1, ("--drafter-port", drafter_port))
    for option, value in ports + ([] if no_http else [("--http-port", http_port)]):
        check_port_free(host, value, option)
    try:
        draft_path = None if no_drafter else resolve_model(draft, "draft")
        target_path = resolve_model(target, "target")
    except CliError as exc:
        raise fail(str(exc)) from None
    except KeyboardInterrupt:
        raise fail("interrupted", 130) from None

    if no_drafter:
        err.print(precision_line(dtype, verifier=verifier_device))
        err.print(_no_drafter_line(v_cores, verifier_threads, draft_source))
    else:
        err.print(precision_line(dtype, drafter=drafter_device, verifier=verifier_device))
    _warn_if_exposed(host, tls=tls.tls_cert is not None, client_token=auth_token_file is not None,
                     client_certs=tls.tls_require_client_cert)
    observability = telemetry.options(tls.tls_cert, tls.tls_key, auth_token_file)
    supervisor = processes.Supervisor(log_dir)
    supervisor.install_signal_handlers()
    engine_token = _engine_token_file(supervisor.log_dir)
    common = ["--host", host, "--dtype", dtype, "--max-message-mb", str(capacity.max_message_mb),
              "--max-sessions", str(capacity.max_sessions), "--session-ttl", str(capacity.session_ttl),
              "--batching" if batch.batching else "--no-batching",
              "--max-batch-tokens", str(batch.max_batch_tokens),
              "--batch-window-ms", str(batch.batch_window_ms),
              "--batch-window-share", str(batch.batch_window_share), "--batch-layout", batch.batch_layout,
              "--prefill-chunk-share", str(batch.prefill_chunk_share),
              "--kv-cache-mb", str(capacity.kv_cache_mb),
              "--prefix-cache-mb", str(capacity.prefix_cache_mb),
              "--admission-timeout", str(capacity.admission_timeout),
              "--cuda-graphs" if graphs.cuda_graphs else "--no-cuda-graphs",
              "--kv-slots", str(graphs.kv_slots), "--kv-slot-tokens", str(graphs.kv_slot_tokens)]

    def engine_child(role: str, model: Path, role_port: int, device: str, cores, threads,
                     extra: tuple[str, ...] = ()) -> processes.Child:
        args = [role, "--model", str(model), "--port", str(role_port), "--device", device, *common,
                *tls_args, "--auth-token-file", str(engine_token), *extra]
        if cores is not None:
            args += ["--cores", processes.format_cores(cores)]
        if threads is not None:
            args += ["--threads", str(threads)]
        args += observability.child_args(role)
        return supervisor.start(supervisor.child(role, args, cores))

    exit_code = 0
    try:
        engines = []
        if draft_path is not None:
            engines.append(engine_child("drafter", draft_path, drafter_port, drafter_device, d_cores,
                                        drafter_threads))
        sharing = () if beside_drafter is None else ("--threads-beside-drafter", str(beside_drafter))
        verifier = engine_child("verifier", target_path, verifier_port, verifier_device, v_cores,
                                verifier_threads, sharing)
        engines.append(verifier)
        loading = "the verifier (loading the target model)" if no_drafter else \
            "drafter and verifier (loading the models)"
        with err.status(f"starting {loading} …") as status:
            for child in engines:
                processes.wait_ready(child, startup_timeout, abort=supervisor.stop_requested, security=probe)
                err.print(f"[green]✓[/] {child.name} healthy on {child.address}")
            status.update("starting the orchestrator …")
            drafter_address = NO_DRAFTER if no_drafter else engines[0].address
            args = ["orchestrator", "--drafter", drafter_address, "--verifier", verifier.address,
                    "--host", host, "--port", str(port), "--max-message-mb", str(capacity.max_message_mb),
                    *tls_args, *orchestrator_args, "--engine-token-file", str(engine_token)]
            for flag, value in (("--default-method", defaults.default_method),
                                ("--default-k", defaults.default_k), ("--default-a", defaults.default_a),
                                ("--draft-source", draft_source), ("--store-url", store_url),
                                ("--draft-rows", limits.draft_rows),
                                ("--draft-model-max-requests", up_draft_model_max_requests(
                                    limits.draft_model_max_requests, drafter_device, verifier_device)),
                                ("--max-active-requests", limits.max_active_requests),
                                ("--queue-timeout", limits.queue_timeout),
                                ("--request-ttl", limits.request_ttl),
                                ("--store-timeout", limits.store_timeout),
                                ("--store-outage-grace", limits.store_outage_grace),
                                ("--max-requests-per-caller", limits.max_requests_per_caller),
                                ("--stream-idle-timeout", limits.stream_idle_timeout),
                                ("--max-prompt-bytes", limits.max_prompt_bytes),
                                ("--served-model-name", served_model_name),
                                ("--chat-template", absolute_path(chat_template)),
                                ("--http-port", None if no_http else http_port)):
                if value is not None:
                    args += [flag, str(value)]
            if limits.adaptive_k is not None:
                args.append("--adaptive-k" if limits.adaptive_k else "--fixed-k")
            close_flag = up_close_chat_turns(limits.close_chat_turns, capacity.prefix_cache_mb)
            if close_flag is not None:
                args.append(close_flag)
            args += observability.child_args("orchestrator")
            orch = supervisor.start(supervisor.child("orchestrator", args))
            processes.wait_ready(orch, startup_timeout, abort=supervisor.stop_requested, security=probe)
            err.print(f"[green]✓[/] orchestrator healthy on {orch.address}")
            if orch.info.get("defaults"):
                err.print(f"  {escape(orch.info['defaults'])}")
        metrics = {c.name: c.info["metrics_url"] for c in supervisor.children if c.info.get("metrics_url")}
        flags = _generate_flags(tls_ca, tls_client_cert, tls_client_key, tls_server_name, auth_token_file)
        _print_pipeline(supervisor, {"drafter": draft, "verifier": target}, metrics, telemetry.trace_file,
                        flags)
        ready = {
            "orchestrator": orch.address, "drafter": None if no_drafter else engines[0].address,
            "verifier": verifier.address, "draft_source": orch.info.get("draft_source"),
            "log_dir": str(supervisor.log_dir), "pids": {c.name: c.pid for c in supervisor.children},
            "pid": os.getpid(), "metrics": metrics, "http": orch.info.get("http_url"),
            "restarts": {c.name: 0 for c in supervisor.children},
        }
        if ready_file is not None:
            processes.write_ready_file(ready_file, ready)
        policies = restart_policies(drafter_restarts, restarts)
        dead = supervisor.supervise(policies, _Reporter(ready, ready_file), startup_timeout=startup_timeout,
                                    security=probe)
        if dead is not None:
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
        engine_token.unlink(missing_ok=True)  # its services are gone: the token opens nothing now
        if ready_file is not None:
            ready_file.unlink(missing_ok=True)
    if exit_code == 0:
        err.print("all services stopped")
    raise typer.Exit(exit_code)


def _check_drafter_options(no_drafter: bool, *, draft: str, draft_source: str | None,
                           drafter_cores: str | None, drafter_threads: int | None,
                           drafter_device: str) -> None:
    """Usage errors (exit 2) of --drafter none: a draft source that needs the draft model (the option,
    else $SPECDEC_DRAFT_SOURCE, which the orchestrator reads too), and options that set up the drafter
    it does not start."""
    from_env = os.environ.get(DRAFT_SOURCE_ENV)
    if draft_source is None and from_env is not None and from_env not in DRAFT_SOURCES:
        raise fail(f"${DRAFT_SOURCE_ENV}={from_env!r} is not one of {', '.join(DRAFT_SOURCES)}", 2)
    if not no_drafter:
        return
    source = draft_source or from_env or DEFAULT_DRAFT_SOURCE
    if source == DraftSource.MODEL:
        given = "--draft-source model" if draft_source else f"${DRAFT_SOURCE_ENV}=model"
        raise fail(f"--drafter none with {given}: that draft source needs the draft model; use "
                   "--draft-source hybrid, lookup or suffix, or start a drafter", 2)
    unused = [flag for flag, given in (("--draft", not is_no_drafter(draft) and draft != DEFAULT_DRAFT_MODEL),
                                       ("--drafter-cores", drafter_cores is not None),
                                       ("--drafter-threads", drafter_threads is not None),
                                       ("--drafter-device", drafter_device != "cpu")) if given]
    if unused:
        raise fail(f"--drafter none starts no drafter, so {', '.join(unused)} would not be used: drop "
                   f"{'it' if len(unused) == 1 else 'them'}, or start a drafter", 2)


def shared_core_widths(verifier_cores: list[int], drafter_cores: list[int], verifier_threads: int | None
                       ) -> tuple[list[int], int, int]:
    """A verifier that shares the drafter's cores: its cores, its threads, and its threads for a pass
    beside a drafter call (serve --threads-beside-drafter).

    By default every pass runs on all the cores, beside a drafter call too. A served verifier whose
    passes switched to its own cores' threads beside each drafter call ran every pass ~25 % slower
    in most starts, long after the switches (2-vCPU AMX Xeon: default `up` 1.29x plain HF on
    grounded prompts against 1.60x without the switch; bench/RESULTS.md, "Inference mode").
    `verifier_threads` (--verifier-threads N) asks for the switch, to N threads."""
    cores = sorted(set(verifier_cores) | set(drafter_cores))
    return cores, len(cores), verifier_threads or len(cores)


def _no_drafter_line(cores: list[int] | None, threads: int, draft_source: str | None) -> str:
    """The start-up line of --drafter none: where the verifier runs, and where drafts come from."""
    source = draft_source or os.environ.get(DRAFT_SOURCE_ENV) or DEFAULT_DRAFT_SOURCE
    available = processes.available_cores()
    if cores is None:
        where = f"is not pinned (--no-pin) and runs {threads} torch thread(s)"
    elif sorted(cores) == available:
        where = (f"gets all {len(cores)} core(s) ({processes.format_cores(cores)}) and {threads} torch "
                 "thread(s)")
    else:
        where = f"runs on core(s) {processes.format_cores(cores)} with {threads} torch thread(s)"
    return (f"no drafter (--drafter none): no draft model is loaded; the verifier {where}; drafts: "
            f"{source}, {WITHOUT_DRAFTER.get(source, 'target-only steps')}")


def restart_policies(drafter_restarts: int | None,
                     restarts: int | None) -> dict[str, processes.RestartPolicy]:
    """How `up` restarts each service: the drafter is optional (the orchestrator drafts without it,
    target-only), so past its limit it stays down; the verifier and the orchestrator are not, so past
    theirs `up` ends."""
    return {"drafter": processes.RestartPolicy(limit=drafter_restarts, fatal=False),
            "verifier": processes.RestartPolicy(limit=restarts),
            "orchestrator": processes.RestartPolicy(limit=restarts)}


# What a client of the orchestrator sees while a service is away (the line of its death).
_MEANWHILE = {
    "drafter": "the orchestrator goes on target-only (exact, slower) meanwhile",
    "verifier": "requests get UNAVAILABLE meanwhile (those in flight can Resume)",
    "orchestrator": "clients get UNAVAILABLE meanwhile (requests in flight can Resume with a shared "
                    "--store-url)",
}


class _Reporter:
    """Supervisor events → one console line each, and `up`'s ready file kept current (new pids)."""

    def __init__(self, ready: dict[str, Any], ready_file: Path | None) -> None:
        self.ready = ready
        self.ready_file = ready_file

    def __call__(self, event: processes.SupervisorEvent) -> None:
        child, policy = event.child, event.policy
        name = child.name
        if event.kind == "died":
            limit = f"{event.restarts + 1}" + ("" if policy.limit is None else f" of {policy.limit}")
            err.print(f"[yellow]warning:[/] {escape(event.reason)}; restarting it in {event.delay:g} s "
                      f"(restart {limit}); {_MEANWHILE.get(name, 'it is away meanwhile')}")
        elif event.kind == "restarting":
            err.print(f"restarting the {name} (pid {child.pid}) on {child.address or 'its port'} …")
        elif event.kind == "healthy":
            err.print(f"[green]✓[/] {name} healthy again on {child.address} (pid {child.pid}, restart "
                      f"{event.restarts})")
            self._update(name, child.pid, event.restarts)
        elif event.kind == "gave_up":
            flag = "--drafter-restarts" if name == "drafter" else "--restarts"
            level, after = (("[bold red]error:[/]", "`up` ends (exit 1)") if policy.fatal else (
                "[yellow]warning:[/]", "the orchestrator goes on target-only (exact, slower) for good"))
            err.print(f"{level} {escape(event.reason)}; not restarted again ({flag} {policy.limit} "
                      f"reached): {after}")
            self._update(name, None, event.restarts)

    def _update(self, name: str, pid: int | None, restarts: int) -> None:
        """The ready file with the service's new pid (none: it stays down) and its restarts."""
        if pid is None:
            self.ready["pids"].pop(name, None)
        else:
            self.ready["pids"][name] = pid
        self.ready["restarts"][name] = restarts
        if self.ready_file is not None:
            processes.write_ready_file(self.ready_file, self.ready)


def _print_pipeline(supervisor: processes.Supervisor, models: dict[str, str], metrics: dict[str, str],
                    trace_file: Path | None, generate_flags: str = "") -> None:
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
    orchestrator = supervisor.children[-1]
    address = orchestrator.address
    flag = "" if address == DEFAULT_ORCHESTRATOR_ADDRESS else f" --address {address}"
    err.print(f"try:  specdec generate{flag}{escape(generate_flags)} \"def quicksort\"")
    if orchestrator.info.get("http_url"):
        err.print(f"      OpenAI-compatible API: {orchestrator.info['http_url']}/v1 (docs/http.md)")
    err.print("stop: Ctrl-C")


# ============================================================================== transport security


def _security_args(tls: ServerTls, *, tls_ca: Path | None, tls_client_cert: Path | None,
                   tls_client_key: Path | None, tls_server_name: str | None,
                   auth_token_file: Path | None, tenants_file: Path | None = None
                   ) -> tuple[list[str], list[str], Any]:
    """Check `up`'s security options (exit 2 on a bad combination, 1 on a bad file, before any model
    loads) and turn them into (every child's server flags, the orchestrator's own flags: its client
    side and its token, the ClientSecurity of `up`'s health checks)."""
    server = tls.security(auth_token_file, tenants_file)
    if server.tls and tls_ca is None:
        raise fail("--tls-cert with `up` needs --tls-ca (the CA that signed it: the orchestrator and `up`'s "
                   "health checks verify the services with it)", 2)
    if not server.tls and (tls_ca is not None or tls_client_cert is not None or tls_server_name is not None):
        raise fail("--tls-ca, --tls-client-cert and --tls-server-name of `up` need --tls-cert and --tls-key "
                   "(its services serve TLS with them)", 2)
    if tls.tls_require_client_cert and tls_client_cert is None:
        raise fail("--tls-require-client-cert with `up` needs --tls-client-cert and --tls-client-key (the "
                   "certificate the orchestrator and `up`'s health checks present)", 2)
    probe = client_security(tls_ca=tls_ca, tls_client_cert=tls_client_cert, tls_client_key=tls_client_key,
                            tls_server_name=tls_server_name)
    tls_args: list[str] = []
    if server.tls:
        tls_args += ["--tls-cert", str(server.cert), "--tls-key", str(server.key)]
    if server.require_client_cert:
        tls_args += ["--tls-client-ca", str(server.client_ca), "--tls-require-client-cert"]
    orchestrator_args: list[str] = []
    for flag, path in (("--tls-ca", probe.tls_ca), ("--tls-client-cert", probe.client_cert),
                       ("--tls-client-key", probe.client_key), ("--tls-server-name", probe.server_name),
                       ("--auth-token-file", absolute_path(auth_token_file)),
                       ("--tenants-file", absolute_path(tenants_file))):
        if path is not None:
            orchestrator_args += [flag, str(path)]
    return tls_args, orchestrator_args, probe


def _engine_token_file(folder: Path) -> Path:
    """A fresh random token for the drafter and the verifier, in a file only this user can read:
    they accept only callers that send it, and only the orchestrator `up` starts is given it."""
    from specdec.rpc.security import write_token_file

    return write_token_file(folder / "engine.token", secrets.token_urlsafe(32))


def _warn_if_exposed(host: str, *, tls: bool, client_token: bool, client_certs: bool) -> None:
    """One warning line per exposed kind of service (the children log theirs too)."""
    from specdec.rpc.security import exposure_warning

    for role, token in (("orchestrator", client_token or client_certs), ("drafter and verifier", True)):
        message = exposure_warning(host, tls=tls, token=token, role=role)
        if message is not None:
            err.print(f"[yellow]warning:[/] {escape(message)}")


def _generate_flags(tls_ca: Path | None, tls_client_cert: Path | None, tls_client_key: Path | None,
                    tls_server_name: str | None, auth_token_file: Path | None) -> str:
    """The flags `specdec generate` needs to reach this orchestrator (shown in the example command)."""
    flags = ""
    for flag, value in (("--tls-ca", tls_ca), ("--tls-client-cert", tls_client_cert),
                        ("--tls-client-key", tls_client_key), ("--tls-server-name", tls_server_name),
                        ("--token-file", auth_token_file)):
        if value is not None:
            flags += f" {flag} {value}"
    return flags

"""`specdec serve drafter|verifier|orchestrator`: one service in the foreground (what `up` runs).

`serve drafter` and `serve verifier` are one command made twice (`_engine_command`): they differ
only in the engine, the default model and the default port. All three end the same way
(`_announce_and_serve`): ready file, one line on stderr, serve until SIGINT / SIGTERM.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape

from specdec.cli import extras, processes
from specdec.cli.commands import ServeCommand, SpecdecGroup
from specdec.cli.common import (
    CliError,
    describe_error,
    err,
    exit_now,
    fail,
    orchestrator_config,
    quiet_transformers,
    resolve_model,
    setup_logging,
)
from specdec.cli.observability import (
    Observability,
    ObservabilityOptions,
)
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
    AuthTokenFileOpt,
    ChatTemplateOpt,
    ChatTemplateTimeoutOpt,
    CoresOpt,
    DeviceOpt,
    DtypeOpt,
    EngineAuthTokenFileOpt,
    EngineTlsCaOpt,
    EngineTlsClientCertOpt,
    EngineTokenFileOpt,
    HostOpt,
    HttpPortOpt,
    InsecureEngineOpt,
    LogLevelOpt,
    MaxChatTemplateKbOpt,
    MaxMessageOpt,
    ModelOpt,
    PortOpt,
    ReadyFileOpt,
    ServedModelNameOpt,
    TenantsFileOpt,
    ThreadsOpt,
    TlsClientKeyOpt,
    TlsServerNameOpt,
    check_port_free,
    client_security,
    connect_address,
    parse_cores,
    refuse_open_engine,
)
from specdec.cli.processes import (
    DEFAULT_DRAFTER_PORT,
    DEFAULT_HOST,
    DEFAULT_ORCHESTRATOR_PORT,
    DEFAULT_VERIFIER_PORT,
    ProcessError,
)
from specdec.defaults import (
    AUTO_PRECISION,
    DEFAULT_DRAFT_MODEL,
    DEFAULT_MAX_MESSAGE_MB,
    DEFAULT_TARGET_MODEL,
    DraftSource,
)

MIB = 1024 * 1024
# `serve orchestrator --drafter none` (and `up --drafter none`): no drafter at all, no draft model.
NO_DRAFTER = "none"
# What each source drafts from when there is no drafter (said on start).
WITHOUT_DRAFTER = {
    "hybrid": "model-free drafts (the request's own n-grams, a cache of recent requests) where they pay, "
              "else target-only steps",
    "lookup": "the request's own n-grams, else target-only steps",
    "suffix": "the request and a cache of recent requests, else target-only steps",
}
def is_no_drafter(value: str | None) -> bool:
    """Whether a --drafter / --draft value means "no drafter" (`none`, any case)."""
    return value is not None and value.strip().lower() == NO_DRAFTER

serve_app = typer.Typer(cls=SpecdecGroup, no_args_is_help=True,
                        help="Run one service in the foreground (`specdec up` starts all three for you).")


async def _announce_and_serve(server: Any, bound: int, *, role: str, host: str, serving: str,
                              ready_file: Path | None, obs: Observability, **ready: Any) -> None:
    """Write the ready file, say where the service listens, then serve until SIGINT / SIGTERM."""
    from specdec.rpc.grpc_support import freeze_startup_objects, serve_until_signal

    freeze_startup_objects()
    if ready_file is not None:
        processes.write_ready_file(ready_file, {"address": connect_address(host, bound), "host": host,
                                                "port": bound, "pid": os.getpid(), "role": role, **ready,
                                                **obs.ready_info()})
    err.print(f"{role} serving {serving} on {connect_address(host, bound)}")
    if obs.metrics_server is not None:
        err.print(f"{role} metrics on {obs.metrics_server.url}")
    await serve_until_signal(server)


# ============================================================================== drafter, verifier


def _engine_and_server(role: str) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """The engine class and the start_*_server function of `role` (drafter | verifier)."""
    if role == "drafter":
        from drafter_service.server import start_drafter_server
        from specdec.engine.drafter import DrafterEngine

        return DrafterEngine, start_drafter_server
    from specdec.engine.verifier import VerifierEngine
    from verifier_service.server import start_verifier_server

    return VerifierEngine, start_verifier_server


def kv_budget_tokens(kv_cache_mb: float, model: Any) -> int | None:
    """--kv-cache-mb as KV tokens of `model` (None for 0: no budget); CliError when not one fits."""
    from specdec.engine.sessions import kv_bytes_per_token

    if kv_cache_mb <= 0:
        return None
    per_token = kv_bytes_per_token(model)
    tokens = int(kv_cache_mb * MIB // per_token)
    if tokens < 1:
        raise CliError(f"--kv-cache-mb {kv_cache_mb:g} holds no token of this model ({per_token} bytes of KV "
                       "cache per token); raise it, or 0 for no limit")
    return tokens


def serve_engine(role: str, *, model: str, host: str, port: int, device: str, dtype: str,
                 threads: int | None, cores: str | None, capacity: EngineCapacity, ready_file: Path | None,
                 log_level: str, observability: ObservabilityOptions, batching: Any = None,
                 security: Any = None,
                 threads_beside_drafter: int | None = None, template_limits: Any = None,
                 cuda_graphs: tuple[int, int] | None = None) -> None:
    """Load the model, build the engine and serve it (role: drafter | verifier) until a signal.

    `cuda_graphs`: (slots, slot tokens) of the KV pool whose passes are captured on CUDA; None: eager.

    security: the port's TLS / mTLS / token (specdec.rpc.security.ServerSecurity, checked by the
    caller before this loads anything); None = plaintext and open. template_limits: the verifier's
    bounds on callers' chat templates (specdec.runtime.chat_template.TemplateLimits; None: defaults)."""
    setup_logging(log_level)
    core_list = parse_cores(cores, "--cores")
    if threads_beside_drafter is not None and role != "verifier":
        raise fail("--threads-beside-drafter is a verifier option (its passes beside the drafter's)", 2)
    check_port_free(host, port, "--port")
    try:
        if core_list is not None:
            processes.pin_current_process(core_list)  # before torch starts its thread pool
            threads = threads or len(core_list)
        path = resolve_model(model, role)
        from specdec.engine.sessions import SessionConfig
        from specdec.runtime.compute_thread import ComputeThread, shorten_gil_switch
        from specdec.runtime.loading import load_model

        quiet_transformers()
        # Loaded on the thread that will run every pass: one OpenMP team (runtime.compute_thread).
        compute = ComputeThread(threads)
        shorten_gil_switch()
        with err.status(f"loading {role} model {path} …"):
            loaded = compute.call(load_model, path, device=device, dtype=dtype, threads=threads)
        loaded.compute = compute
        engine_class, start_server = _engine_and_server(role)
        max_kv_tokens = kv_budget_tokens(capacity.kv_cache_mb, loaded.model)
        sessions = SessionConfig(max_sessions=capacity.max_sessions, ttl_seconds=capacity.session_ttl,
                                 max_kv_tokens=max_kv_tokens, admission_timeout_s=capacity.admission_timeout)
        prefix_cache_mb = capacity.prefix_cache_mb
        extra: dict[str, Any] = {"template_limits": template_limits} if role == "verifier" else {}
        if prefix_cache_mb > 0:
            from specdec.runtime.prefix_cache import PrefixStore

            extra["prefix_cache"] = PrefixStore(int(prefix_cache_mb * MIB))
        if cuda_graphs is not None and loaded.device.type == "cuda":
            from specdec.runtime.kv_pool import PoolConfig

            slots, slot_tokens = cuda_graphs
            context = loaded.info.max_context
            extra["kv_pool"] = PoolConfig(slots=slots, slot_tokens=min(slot_tokens, context) if context > 0
                                          else slot_tokens)
            err.print(f"{role}: capturing CUDA graphs for {slots} KV slots of {slot_tokens} tokens …")
        if threads_beside_drafter is not None:
            import torch

            from specdec.runtime.batching import ThreadWidths

            wide = threads or torch.get_num_threads()
            widths = ThreadWidths(wide=wide, beside_drafter=min(threads_beside_drafter, wide))
            engine = engine_class(loaded, sessions, batching=batching, threads=widths, **extra)
        else:
            engine = engine_class(loaded, sessions, batching=batching, **extra)
        protected = security is not None and (security.tls or security.authenticated)
        obs = observability.setup(role, protected=protected)
        obs.watch_engine(engine)
    except CliError as exc:
        raise fail(str(exc)) from None
    except (ProcessError, ValueError, OSError, RuntimeError, AssertionError) as exc:  # e.g. no such device
        raise fail(f"{role}: {exc}") from None

    async def main() -> None:
        from specdec.rpc.security import ServerSecurity, warn_if_exposed
        from specdec.runtime.compute_thread import serial_torch

        door = security if security is not None else ServerSecurity()
        warn_if_exposed(host, tls=door.tls, token=door.authenticated, role=role)
        server, bound = await start_server(engine, host, port, max_message_mb=capacity.max_message_mb,
                                           max_workers=engine.batching.workers,
                                           interceptors=[*door.interceptors(), *obs.server_interceptors],
                                           observers=obs.service_observers, credentials=door.credentials,
                                           worker_initializer=serial_torch)
        info = loaded.info
        budget = f"{max_kv_tokens} KV tokens" if max_kv_tokens is not None else "no KV budget"
        budget += f", prefix cache {prefix_cache_mb:g} MiB" if prefix_cache_mb > 0 else ", no prefix cache"
        await _announce_and_serve(
            server, bound, role=role, host=host, ready_file=ready_file, obs=obs,
            serving=f"{escape(info.model_id)} (vocab {info.vocab_size}, {info.device}, {budget})",
            model_id=info.model_id, vocab_size=info.vocab_size, kv_budget_tokens=max_kv_tokens)

    try:
        asyncio.run(main())
    except OSError as exc:  # port in use
        raise fail(f"{role}: {exc}") from None
    finally:
        obs.shutdown()  # flush spans, stop /metrics
    exit_now(0)


def _engine_command(role: str, default_model: str, default_port: int, summary: str) -> Callable[..., None]:
    """The `serve ROLE` command of an engine service: the same options, its own defaults."""

    def command(
        *,
        model: ModelOpt = default_model,
        host: HostOpt = DEFAULT_HOST,
        port: PortOpt = default_port,
        device: DeviceOpt = "cpu",
        dtype: DtypeOpt = AUTO_PRECISION,
        threads: ThreadsOpt = None,
        cores: CoresOpt = None,
        capacity: EngineCapacity,
        ready_file: ReadyFileOpt = None,
        log_level: LogLevelOpt = "info",
        telemetry: Telemetry,
        batch: EngineBatching,
        tls: ServerTls,
        auth_token_file: EngineAuthTokenFileOpt = None,
        insecure_engine: InsecureEngineOpt = False,
        max_chat_template_kb: MaxChatTemplateKbOpt = 64,
        chat_template_timeout: ChatTemplateTimeoutOpt = 2.0,
        graphs: CudaGraphs,
        threads_beside_drafter: Annotated[int | None, typer.Option(
            "--threads-beside-drafter", min=1, rich_help_panel="Models and placement",
            help="Verifier only: torch threads of a pass while a drafter call runs beside it; the other "
                 "passes (the orchestrator says the drafter is idle) use all --threads. For a verifier "
                 "pinned to the drafter's cores too (`specdec up` does this). Default: always --threads.",
            show_default=False)] = None,
    ) -> None:
        from specdec.runtime.batch_config import BatchConfig
        from specdec.runtime.chat_template import TemplateLimits

        security = tls.security(auth_token_file)  # exits on a bad flag, before loading
        refuse_open_engine(role, host, security, insecure_engine)
        observability = telemetry.options(security.cert, security.key, auth_token_file)
        batching = BatchConfig(batch.batching, batch.max_batch_tokens, batch.batch_window_ms,
                               batch.batch_layout, batch.batch_window_share, batch.prefill_chunk_share)
        template_limits = TemplateLimits(max_template_bytes=max_chat_template_kb * 1024,
                                         timeout_s=chat_template_timeout)
        serve_engine(role, model=model, host=host, port=port, device=device, dtype=dtype, threads=threads,
                     cores=cores, capacity=capacity, ready_file=ready_file, log_level=log_level,
                     observability=observability, batching=batching, security=security,
                     threads_beside_drafter=threads_beside_drafter, template_limits=template_limits,
                     cuda_graphs=graphs.pool)

    command.__name__ = command.__qualname__ = f"serve_{role}"
    command.__doc__ = summary
    return takes_option_groups(command)


serve_drafter = serve_app.command("drafter", cls=ServeCommand)(_engine_command(
    "drafter", DEFAULT_DRAFT_MODEL, DEFAULT_DRAFTER_PORT,
    "Serve the draft model (DrafterService + gRPC health) until Ctrl-C / SIGTERM."))
serve_verifier = serve_app.command("verifier", cls=ServeCommand)(_engine_command(
    "verifier", DEFAULT_TARGET_MODEL, DEFAULT_VERIFIER_PORT,
    "Serve the target model (VerifierService + gRPC health) until Ctrl-C / SIGTERM."))


# ================================================================================== orchestrator


def read_chat_template(path: Path | None) -> str | None:
    """The text of --chat-template (checked to exist by the option), or None."""
    if path is None:
        return None
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise fail(f"--chat-template {path}: {exc}") from None
    if not text.strip():
        raise fail(f"--chat-template {path}: the file is empty")
    return text


def http_url(host: str, port: int, tls: bool) -> str:
    address = connect_address(host, port)
    return f"{'https' if tls else 'http'}://{address}"


async def start_http_api(orchestrator: Any, host: str, port: int, *, security: Any,
                         served_model_name: str | None, config: Any, metrics: Any = None) -> Any:
    """The OpenAI-compatible HTTP API over `orchestrator` (orchestrator.openai_http), with the gRPC
    port's TLS and tokens; bodies are capped at 4x max_prompt_bytes plus 1 MiB (a chat's JSON);
    `metrics` (orchestrator.metrics.HttpMetrics) counts its requests on /metrics."""
    from orchestrator.openai_http.app import create_app
    from orchestrator.openai_http.server import HttpTls, start_http_server

    tls = None
    if security.tls:
        tls = HttpTls(str(security.cert), str(security.key),
                      None if security.client_ca is None else str(security.client_ca),
                      security.require_client_cert)
    app = create_app(orchestrator, served_model_name=served_model_name, tokens=security.tokens,
                     tenants=security.tenants)
    return await start_http_server(app, host, port, tls=tls, max_body_bytes=4 * config.max_prompt_bytes + MIB,
                                   metrics=metrics)


@serve_app.command("orchestrator", cls=ServeCommand)
@takes_option_groups
def serve_orchestrator(
    *,
    drafter: Annotated[str, typer.Option("--drafter", help=(
        "Address of the drafter service, host:port. A DNS name that resolves to several addresses (a "
        "Kubernetes headless Service) means several replicas: each request's sessions stay on one, "
        "re-resolved every 5 s. none: no drafter at all (no draft model anywhere): requests draft "
        "model-free (--draft-source hybrid, lookup or suffix) or take target-only steps; --draft-source "
        "model is then a usage error."))] =
        f"{DEFAULT_HOST}:{DEFAULT_DRAFTER_PORT}",
    verifier: Annotated[str, typer.Option("--verifier", help=(
        "Address of the verifier service, host:port (several replicas behind a DNS name as for "
        "--drafter)."))] =
        f"{DEFAULT_HOST}:{DEFAULT_VERIFIER_PORT}",
    host: HostOpt = DEFAULT_HOST,
    port: PortOpt = DEFAULT_ORCHESTRATOR_PORT,
    max_message_mb: MaxMessageOpt = DEFAULT_MAX_MESSAGE_MB,
    defaults: RequestDefaults,
    store_url: Annotated[str | None, typer.Option(
        "--store-url", help="redis://host:port/db keeps requests and calibration in Redis. "
        "Default: $SPECDEC_STORE_URL, else in memory.", show_default=False)] = None,
    limits: OrchestratorLimits,
    http_port: HttpPortOpt = None,
    served_model_name: ServedModelNameOpt = None,
    chat_template: ChatTemplateOpt = None,
    peer_timeout: Annotated[float, typer.Option(
        "--peer-timeout", help="Seconds after which a verifier that has not answered since startup is "
        "reported (a warning); the orchestrator listens meanwhile, NOT_SERVING, and keeps waiting.")] = 60.0,
    ready_file: ReadyFileOpt = None,
    log_level: LogLevelOpt = "info",
    telemetry: Telemetry,
    tls: ServerTls,
    auth_token_file: AuthTokenFileOpt = None,
    tenants_file: TenantsFileOpt = None,
    tls_ca: EngineTlsCaOpt = None,
    tls_client_cert: EngineTlsClientCertOpt = None,
    tls_client_key: TlsClientKeyOpt = None,
    tls_server_name: TlsServerNameOpt = None,
    engine_token_file: EngineTokenFileOpt = None,
) -> None:
    """Serve the public GenerationService over a drafter and a verifier until Ctrl-C / SIGTERM.

    The model pair is checked at startup: if the drafter's vocabulary size or tokenizer differs
    from the verifier's, the orchestrator refuses to start (exit code 1, the reason on stderr).
    An unreachable drafter is no error: requests run target-only until it answers. With
    --drafter none there is no drafter: drafts are model-free (--draft-source) or none.
    """
    setup_logging(log_level)
    # Transport security (docs/security.md), checked before anything starts; exits on a bad flag.
    front = tls.security(auth_token_file, tenants_file)
    engine_security = client_security(tls_ca=tls_ca, tls_client_cert=tls_client_cert,
                                      tls_client_key=tls_client_key, tls_server_name=tls_server_name,
                                      token_file=engine_token_file, token_flag="--engine-token-file")
    try:
        config = orchestrator_config(defaults.default_method, defaults.default_k, defaults.default_a,
                                     store_url, limits.draft_rows, limits.adaptive_k,
                                     limits.max_active_requests, limits.queue_timeout, limits.request_ttl,
                                     limits.max_prompt_bytes, read_chat_template(chat_template),
                                     limits.draft_model_max_requests)
        # Checked by the options; the command line wins over the variables.
        if defaults.draft_source is not None:
            config = config.model_copy(update={"draft_source": defaults.draft_source})
        if limits.config_fields:
            config = config.model_copy(update=limits.config_fields)
    except CliError as exc:
        raise fail(str(exc)) from None
    if http_port is not None:  # optional packages: one line and exit 2 when absent (specdec.cli.extras)
        extras.require(extras.HTTP_API, "--http-port", "leave --http-port out (gRPC only)")
    if extras.is_redis_url(config.store_url):
        extras.require(extras.REDIS_STORE, "--store-url / $SPECDEC_STORE_URL", "leave the store in memory")
    no_drafter = is_no_drafter(drafter)
    if no_drafter and config.draft_source == DraftSource.MODEL:
        raise fail("--drafter none with draft source model (--draft-source or $SPECDEC_DRAFT_SOURCE): that "
                   "source needs a drafter; choose hybrid, lookup or suffix, or give --drafter an address", 2)
    try:
        check_port_free(host, port, "--port")
        if http_port:
            check_port_free(host, http_port, "--http-port")
        observability = telemetry.options(front.cert, front.key, auth_token_file)
        obs = observability.setup("orchestrator", protected=front.tls or front.authenticated)
    except CliError as exc:
        raise fail(str(exc)) from None

    async def main() -> None:
        from orchestrator.clients.replicas import engine_client
        from orchestrator.failover import describe_defaults
        from orchestrator.server import start_orchestrator_server
        from orchestrator.speculation import Orchestrator
        from specdec.errors import PeerUnavailable
        from specdec.rpc.security import warn_if_exposed

        warn_if_exposed(host, tls=front.tls, token=front.authenticated, role="orchestrator")
        client_options = {"max_message_mb": max_message_mb, "interceptors": obs.client_interceptors,
                          "security": engine_security}
        # A DNS name (e.g. a headless Service) may stand for several replicas: each request's sessions
        # stay on one of them (orchestrator.clients.replicas); an IP address is one server.
        draft_client = None if no_drafter else engine_client("drafter", drafter, **client_options)
        orchestrator = Orchestrator(draft_client, engine_client("verifier", verifier, **client_options),
                                    config, observer=obs.loop_observer)
        obs.watch_orchestrator(orchestrator)  # request slots on /metrics (read at scrape time)
        try:
            # Listen at once: health says NOT_SERVING, and requests get UNAVAILABLE "verifier not
            # ready", until the verifier answers (its health monitor, orchestrator.health); a late
            # verifier is waited for, never fatal. The ready file (`specdec up`) is written only then.
            server, bound = await start_orchestrator_server(
                orchestrator, host, port, max_message_mb=max_message_mb, credentials=front.credentials,
                tenants=front.tenants,
                interceptors=[*front.interceptors(), *obs.server_interceptors])
            http = None
            try:
                if http_port is not None:  # the OpenAI API, at once too: /health says 503 until serving
                    http = await start_http_api(orchestrator, host, http_port, security=front,
                                                served_model_name=served_model_name, config=config,
                                                metrics=obs.http_metrics)
                waiting_since, warned = time.monotonic(), False
                while True:
                    try:
                        await orchestrator.ensure_serving()  # a refused pair raises InvalidRequest
                        break
                    except PeerUnavailable as exc:
                        if not warned and time.monotonic() - waiting_since >= peer_timeout:
                            warned = True
                            err.print(f"[yellow]warning:[/] orchestrator on {connect_address(host, bound)}: "
                                      f"no usable verifier at {escape(verifier)} after {peer_timeout:g} s "
                                      f"({escape(str(exc))}); NOT_SERVING, still waiting")
                        await asyncio.sleep(0.5)
            except BaseException:
                from specdec.rpc.grpc_support import stop_server

                await stop_server(server, 0.5)
                if http is not None:
                    await http.stop(0.5)
                raise
            draft_id = (orchestrator.draft_info.model_id if orchestrator.draft_info
                        else "(no drafter)" if no_drafter else "(drafter down)")
            target_id = orchestrator.target_info.model_id
            info = (orchestrator.draft_info, orchestrator.target_info)
            defaults = describe_defaults(orchestrator.config, *info, has_drafter=not no_drafter)
            err.print(f"orchestrator {escape(defaults)}")
            if no_drafter:
                source = orchestrator.config.draft_source
                err.print(f"orchestrator without a drafter (--drafter none): draft source {source}: "
                          f"{WITHOUT_DRAFTER.get(source, 'target-only steps')}")
            obs.set_model(served_model_name or target_id)  # the metrics' model label, the spans' model
            began = time.monotonic()  # the warm-up, before the ready file (none at warm_up_tokens 0)
            warmed = await orchestrator.warm_up()
            if warmed is not None:
                err.print(f"orchestrator warm-up: {len(warmed.token_ids)} tokens in "
                          f"{time.monotonic() - began:.1f} s ({warmed.stats.iterations} iterations; "
                          f"$SPECDEC_WARM_UP_TOKENS=0 skips it)")
            http_info = {} if http is None else {"http_url": http_url(host, http.port, front.tls)}
            if http is not None:
                err.print(f"orchestrator OpenAI-compatible HTTP API on {http_info['http_url']}/v1 (model "
                          f"{escape(served_model_name or target_id)})")
            try:
                await _announce_and_serve(server, bound, role="orchestrator", host=host,
                                          ready_file=ready_file, obs=obs,
                                          serving=f"{escape(draft_id)} → {escape(target_id)}",
                                          drafter=None if no_drafter else drafter, verifier=verifier,
                                          draft_source=orchestrator.config.draft_source, defaults=defaults,
                                          **http_info)
            finally:
                if http is not None:
                    await http.stop()
        finally:
            await orchestrator.close()

    from specdec.errors import InvalidRequest

    try:
        try:
            asyncio.run(main())
        finally:
            obs.shutdown()  # flush spans, stop /metrics
        exit_now(0)
    except InvalidRequest as exc:  # the pair is refused (vocabulary / tokenizer mismatch)
        raise fail(f"orchestrator refuses to start: {exc}") from None
    except OSError as exc:  # port in use
        raise fail(f"orchestrator: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - e.g. verifier unreachable: one line, no traceback
        raise fail(f"orchestrator: {describe_error(exc)}") from None

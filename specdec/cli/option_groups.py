"""The runs of options that `serve drafter|verifier`, `serve orchestrator` and `up` share, each declared
once: an option group is a frozen dataclass whose fields are its options (`name: SomeOpt = default`,
the types from specdec.cli.options and specdec.cli.observability).

A command takes a group as one parameter (`capacity: EngineCapacity = EngineCapacity()`) and is
wrapped by `takes_option_groups`, which shows typer the group's options in that parameter's place
(same flags, help, defaults, panels and order as options written out one by one) and calls the
command with one instance of the group. A command that words one option of a group its own way
subclasses the group and redeclares that field (a dataclass keeps the field's place).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer

from specdec.cli.observability import (
    MetricsHostOpt,
    MetricsPortOpt,
    MetricsTlsOpt,
    MetricsTokenFileOpt,
    ObservabilityOptions,
    OpenMetricsOpt,
    OtlpEndpointOpt,
    TraceFileOpt,
)
from specdec.cli.options import (
    DEFAULT_ADMISSION_TIMEOUT_S,
    DEFAULT_KV_CACHE_MB,
    DEFAULT_MAX_SESSIONS,
    DEFAULT_PREFIX_CACHE_MB,
    AdaptiveKOpt,
    AdmissionTimeoutOpt,
    BatchingOpt,
    BatchLayoutOpt,
    BatchWindowOpt,
    BatchWindowShareOpt,
    CloseChatTurnsOpt,
    CudaGraphsOpt,
    DefaultAOpt,
    DefaultKOpt,
    DefaultMethodOpt,
    DraftModelMaxRequestsOpt,
    DraftRowsOpt,
    KvCacheOpt,
    KvSlotsOpt,
    KvSlotTokensOpt,
    MaxActiveRequestsOpt,
    MaxBatchTokensOpt,
    MaxMessageOpt,
    MaxPromptBytesOpt,
    MaxRequestsPerCallerOpt,
    MaxSessionsOpt,
    PrefillChunkShareOpt,
    PrefixCacheOpt,
    QueueTimeoutOpt,
    RequestTtlOpt,
    SessionTtlOpt,
    StoreOutageGraceOpt,
    StoreTimeoutOpt,
    StreamIdleTimeoutOpt,
    TlsCertOpt,
    TlsClientCaOpt,
    TlsKeyOpt,
    TlsRequireClientCertOpt,
    one_of,
    server_security,
)
from specdec.defaults import DEFAULT_DRAFT_SOURCE, DEFAULT_MAX_MESSAGE_MB, DRAFT_SOURCES
from specdec.runtime.batch_config import (
    DEFAULT_BATCH_LAYOUT,
    DEFAULT_BATCH_WINDOW_MS,
    DEFAULT_BATCH_WINDOW_SHARE,
    DEFAULT_MAX_BATCH_TOKENS,
    DEFAULT_POOL_SLOTS,
    DEFAULT_PREFILL_CHUNK_SHARE,
    DEFAULT_SLOT_TOKENS,
)

if typing.TYPE_CHECKING:
    from specdec.rpc.security import ServerSecurity

F = TypeVar("F", bound=Callable[..., Any])

# The orchestrator's default draft source: `serve orchestrator` and `up` (RequestDefaults).
DraftSourceOpt = Annotated[str | None, typer.Option(
    "--draft-source", callback=one_of(DRAFT_SOURCES), rich_help_panel="Speculation", help=(
        f"Where the drafts of requests that name no draft_source come from: {' | '.join(DRAFT_SOURCES)}. "
        "hybrid: per iteration a model-free draft (n-grams of the request's own prompt and output, or a "
        "cache of recent requests of this orchestrator process) where it pays, else the draft model, else "
        "a target-only step; model: the draft model only; lookup: the request's own n-grams only; suffix: "
        "the request and the recent-requests cache only. Every source is verified exactly: the output's "
        "law is the target's. Without a drafter (--drafter none) model is refused. Default: "
        f"$SPECDEC_DRAFT_SOURCE, else {DEFAULT_DRAFT_SOURCE}."), show_default=False)]


def takes_option_groups(command: F) -> F:
    """`command` as typer should see it: each parameter typed with an option group (a dataclass)
    spread into the group's options in its place; called, the command gets one group instance."""
    hints = typing.get_type_hints(command, include_extras=True)
    groups: dict[str, type] = {}
    parameters: list[inspect.Parameter] = []
    for param in inspect.signature(command).parameters.values():
        annotation = hints.get(param.name, param.annotation)
        if not (isinstance(annotation, type) and dataclasses.is_dataclass(annotation)):
            parameters.append(param.replace(annotation=annotation))
            continue
        groups[param.name] = annotation
        options = typing.get_type_hints(annotation, include_extras=True)
        parameters += [inspect.Parameter(f.name, param.kind, default=f.default, annotation=options[f.name])
                       for f in dataclasses.fields(annotation)]

    @functools.wraps(command)
    def run(**values: Any) -> Any:
        for name, group in groups.items():
            values[name] = group(**{f.name: values.pop(f.name) for f in dataclasses.fields(group)})
        return command(**values)

    run.__signature__ = inspect.Signature(parameters, return_annotation=hints.get("return"))  # type: ignore[attr-defined]
    run.__annotations__ = {p.name: p.annotation for p in parameters} | {"return": hints.get("return")}
    return typing.cast(F, run)


@dataclasses.dataclass(frozen=True)
class EngineCapacity:
    """An engine's message, session and KV-cache limits (`serve drafter|verifier`; `up` passes them on)."""

    max_message_mb: MaxMessageOpt = DEFAULT_MAX_MESSAGE_MB
    max_sessions: MaxSessionsOpt = DEFAULT_MAX_SESSIONS
    session_ttl: SessionTtlOpt = 600.0
    kv_cache_mb: KvCacheOpt = DEFAULT_KV_CACHE_MB
    prefix_cache_mb: PrefixCacheOpt = DEFAULT_PREFIX_CACHE_MB
    admission_timeout: AdmissionTimeoutOpt = DEFAULT_ADMISSION_TIMEOUT_S


@dataclasses.dataclass(frozen=True)
class EngineBatching:
    """How an engine batches the passes of concurrent calls."""

    batching: BatchingOpt = True
    max_batch_tokens: MaxBatchTokensOpt = DEFAULT_MAX_BATCH_TOKENS
    batch_window_ms: BatchWindowOpt = DEFAULT_BATCH_WINDOW_MS
    batch_window_share: BatchWindowShareOpt = DEFAULT_BATCH_WINDOW_SHARE
    batch_layout: BatchLayoutOpt = DEFAULT_BATCH_LAYOUT
    prefill_chunk_share: PrefillChunkShareOpt = DEFAULT_PREFILL_CHUNK_SHARE


@dataclasses.dataclass(frozen=True)
class CudaGraphs:
    """The KV pool whose passes an engine captures as CUDA graphs (on a CUDA device)."""

    cuda_graphs: CudaGraphsOpt = True
    kv_slots: KvSlotsOpt = DEFAULT_POOL_SLOTS
    kv_slot_tokens: KvSlotTokensOpt = DEFAULT_SLOT_TOKENS

    @property
    def pool(self) -> tuple[int, int] | None:
        """(slots, slot tokens) of the captured pool; None: eager passes (--no-cuda-graphs)."""
        return (self.kv_slots, self.kv_slot_tokens) if self.cuda_graphs else None


@dataclasses.dataclass(frozen=True)
class RequestDefaults:
    """What a request that names no method, k, a or draft source gets (the orchestrator's)."""

    default_method: DefaultMethodOpt = None
    default_k: DefaultKOpt = None
    default_a: DefaultAOpt = None
    draft_source: DraftSourceOpt = None


@dataclasses.dataclass(frozen=True)
class OrchestratorLimits:
    """The orchestrator's draft rows and k policy, and its bounds on requests, callers and its store."""

    draft_rows: DraftRowsOpt = None
    adaptive_k: AdaptiveKOpt = None
    draft_model_max_requests: DraftModelMaxRequestsOpt = None
    close_chat_turns: CloseChatTurnsOpt = None
    max_active_requests: MaxActiveRequestsOpt = None
    queue_timeout: QueueTimeoutOpt = None
    request_ttl: RequestTtlOpt = None
    store_timeout: StoreTimeoutOpt = None
    store_outage_grace: StoreOutageGraceOpt = None
    max_requests_per_caller: MaxRequestsPerCallerOpt = None
    stream_idle_timeout: StreamIdleTimeoutOpt = None
    max_prompt_bytes: MaxPromptBytesOpt = None

    @property
    def config_fields(self) -> dict[str, Any]:
        """The store and stream bounds and the chat-turn close given on the command line, as
        OrchestratorConfig fields."""
        given = {"store_timeout_s": self.store_timeout, "store_outage_grace_s": self.store_outage_grace,
                 "max_requests_per_caller": self.max_requests_per_caller,
                 "stream_idle_timeout_s": self.stream_idle_timeout, "close_chat_turns": self.close_chat_turns}
        return {key: value for key, value in given.items() if value is not None}


@dataclasses.dataclass(frozen=True)
class Telemetry:
    """Spans and the Prometheus /metrics endpoint of a service."""

    trace_file: TraceFileOpt = None
    otlp_endpoint: OtlpEndpointOpt = None
    metrics_port: MetricsPortOpt = None
    metrics_host: MetricsHostOpt = "127.0.0.1"
    metrics_token_file: MetricsTokenFileOpt = None
    open_metrics: OpenMetricsOpt = False
    metrics_tls: MetricsTlsOpt = False

    def options(self, cert: Path | None, key: Path | None,
                auth_token_file: Path | None) -> ObservabilityOptions:
        """Checked with the service's certificate, key and token (a bad token file exits 1,
        --metrics-tls without a certificate 2): specdec.cli.observability.ObservabilityOptions."""
        return ObservabilityOptions(self.trace_file, self.otlp_endpoint, self.metrics_port, self.metrics_host,
                                    self.metrics_token_file, self.metrics_tls, cert, key, auth_token_file,
                                    self.open_metrics)


@dataclasses.dataclass(frozen=True)
class ServerTls:
    """The TLS / mTLS of a service's port (docs/security.md)."""

    tls_cert: TlsCertOpt = None
    tls_key: TlsKeyOpt = None
    tls_client_ca: TlsClientCaOpt = None
    tls_require_client_cert: TlsRequireClientCertOpt = False

    def security(self, auth_token_file: Path | None, tenants_file: Path | None = None) -> ServerSecurity:
        """The port's checked security with its token (specdec.cli.options.server_security)."""
        return server_security(tls_cert=self.tls_cert, tls_key=self.tls_key, tls_client_ca=self.tls_client_ca,
                               tls_require_client_cert=self.tls_require_client_cert,
                               auth_token_file=auth_token_file, tenants_file=tenants_file)

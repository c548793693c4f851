"""Option types shared by several commands (`serve *`, `up`, `generate`) and small parse helpers.

The observability options (--trace-file, --otlp-endpoint, --metrics-port, --metrics-host) live
in specdec.cli.observability with the rest of that set-up.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from orchestrator import processes
from specdec.cli.common import fail
from specdec.defaults import AUTO_PRECISION, PRECISIONS, resolve_precision

ModelOpt = Annotated[str, typer.Option("--model", "-m", help="Registry name or path (HF folder or .gguf).")]
HostOpt = Annotated[str, typer.Option("--host", help="Interface to listen on.")]
PortOpt = Annotated[int, typer.Option("--port", help="Port to listen on (0 = any free port).")]
DeviceOpt = Annotated[str, typer.Option("--device", help="torch device of the model (cpu, cuda, mps).")]
PRECISION_CHOICES = (AUTO_PRECISION, *PRECISIONS)


def _one_of(choices: tuple[str, ...]):
    """A parse-time check (a usage error, exit 2, before any model loads) that a value is a choice."""

    def check(value: str | None) -> str | None:
        if value is not None and value not in choices:
            raise typer.BadParameter(f"{value!r} is not one of {', '.join(choices)}")
        return value

    return check


DtypeOpt = Annotated[str, typer.Option("--dtype", callback=_one_of(PRECISION_CHOICES), help=(
    "Weights precision: auto | float32 | bfloat16 | float16 | int8. auto: the device's fast "
    "precision (int8 on a CPU, bfloat16 on a CUDA GPU, else float32). int8: every Linear "
    "dynamically quantised to int8 per channel (CPU only; several times faster than float32 on "
    "CPUs without bf16 units). The output is distributed exactly as the target model at the chosen "
    "precision."))]
ThreadsOpt = Annotated[int | None, typer.Option(
    "--threads", help="torch CPU threads. Default: the number of --cores, else torch's default.",
    show_default=False)]
CoresOpt = Annotated[str | None, typer.Option(
    "--cores", help="Pin this process to these CPU cores, e.g. 0 or 0,2-3 (os.sched_setaffinity). "
    "Default: no pinning.", show_default=False)]
MaxMessageOpt = Annotated[float, typer.Option("--max-message-mb", help="gRPC message size limit (MB).")]
# orchestrator.config.DraftRowsMode, spelled out: the CLI starts without pydantic (a test checks they agree).
DRAFT_ROWS_CHOICES = ("lean", "full")
DraftRowsOpt = Annotated[str | None, typer.Option(
    "--draft-rows", callback=_one_of(DRAFT_ROWS_CHOICES), help=(
        "How the orchestrator sends the drafter's distributions to the verifier (docs/algorithms.md "
        "§12): lean | full. lean: for token, rd and gsd-tree, each draft token's probability only, and "
        "a whole row of V floats only where the verifier asks for it after a rejection (one more round "
        "trip then); full: every row (k + 1 rows of V float32) with every verify. The output is the "
        "same either way. Default: $SPECDEC_DRAFT_ROWS, else lean."), show_default=False)]
AdaptiveKOpt = Annotated[bool | None, typer.Option(
    "--adaptive-k/--fixed-k", help=(
        "Draft length of requests that name neither k nor a seed: picked online from this pair's "
        "measured acceptance and call times, down to 0 (target-only steps) when drafting cannot pay "
        "(--adaptive-k), or always the default k (--fixed-k). Default: $SPECDEC_ADAPTIVE_K, else "
        "adaptive."), show_default=False)]
BatchingOpt = Annotated[bool, typer.Option(
    "--batching/--no-batching", help=(
        "Run the forward passes of concurrent calls from different sessions as one batched pass "
        "(continuous batching; each session keeps its own KV cache and the verification math stays "
        "per session, so outputs are unchanged). --no-batching runs engine calls one at a time."))]
MaxBatchTokensOpt = Annotated[int, typer.Option(
    "--max-batch-tokens", min=1, help="At most this many query positions (sessions x padded new tokens) "
    "in one batched pass.")]
BatchWindowOpt = Annotated[float, typer.Option(
    "--batch-window-ms", min=0.0, max=1000.0, help="How long a pass waits for calls still on their way "
    "before it starts (only while other calls are in flight).")]
# Engine defaults, spelled out: the CLI starts without torch (specdec.engine.sessions.SessionConfig's and
# orchestrator.config's defaults; a test checks they agree).
DEFAULT_MAX_SESSIONS = 1024
DEFAULT_KV_CACHE_MB = 2048.0
DEFAULT_ADMISSION_TIMEOUT_S = 30.0
DEFAULT_MAX_ACTIVE_REQUESTS = 64
DEFAULT_QUEUE_TIMEOUT_S = 60.0
MaxSessionsOpt = Annotated[int, typer.Option(
    "--max-sessions", min=1, help="At most this many sessions (KV caches) kept, on top of the KV budget "
    "(--kv-cache-mb, which usually binds first); idle ones are evicted least recently used first.")]
SessionTtlOpt = Annotated[float, typer.Option(
    "--session-ttl", help="Seconds an idle session is kept; a background sweep frees it after that (its "
    "caller then resends the context).")]
KvCacheOpt = Annotated[float, typer.Option(
    "--kv-cache-mb", min=0.0, help=(
        "Memory budget of the sessions' KV caches, per engine (MiB; 0 = no limit but --max-sessions), "
        "turned into tokens from the model's layers, KV heads, head size and dtype. Idle sessions are "
        "evicted least recently used first to stay within it; when only busy sessions hold it, a call that "
        "needs a new session waits up to --admission-timeout, then gets RESOURCE_EXHAUSTED."))]
AdmissionTimeoutOpt = Annotated[float, typer.Option(
    "--admission-timeout", min=0.0, help="Seconds a call that needs a new session waits for room while "
    "every session is busy and the KV budget or --max-sessions is full, before RESOURCE_EXHAUSTED.")]
MaxActiveRequestsOpt = Annotated[int | None, typer.Option(
    "--max-active-requests", min=1, help=(
        "Requests the orchestrator runs at once; later ones wait in arrival order for up to "
        "--queue-timeout, then get RESOURCE_EXHAUSTED. Default: $SPECDEC_MAX_ACTIVE_REQUESTS, else "
        f"{DEFAULT_MAX_ACTIVE_REQUESTS}."), show_default=False)]
QueueTimeoutOpt = Annotated[float | None, typer.Option(
    "--queue-timeout", min=0.0, help=(
        "Seconds a request waits for one of the --max-active-requests slots before RESOURCE_EXHAUSTED. "
        f"Default: $SPECDEC_QUEUE_TIMEOUT_S, else {DEFAULT_QUEUE_TIMEOUT_S:g}."), show_default=False)]
ReadyFileOpt = Annotated[Path | None, typer.Option(
    "--ready-file", help="Once serving, write JSON {address, host, port, pid, ...} to this file.",
    show_default=False)]
LogLevelOpt = Annotated[str, typer.Option("--log-level", help="Python logging level.")]


def parse_cores(text: str | None, option: str) -> list[int] | None:
    """'0,2-3' → [0, 2, 3]; None → None (no pinning); a usage error (exit 2) naming `option` when bad."""
    try:
        return processes.parse_cores(text)
    except ValueError as exc:
        raise typer.BadParameter(f"{exc} (expected e.g. 0 or 0,2-3)", param_hint=option) from None


def check_port_free(host: str, port: int, option: str) -> None:
    """Exit 1 with one line naming `option` when host:port is taken (port 0 is always free)."""
    if processes.port_in_use(host, port):
        raise fail(f"{host}:{port} is already in use (another `specdec up` or service?); choose another "
                   f"{option}, or 0 for any free port")


def connect_address(host: str, port: int) -> str:
    """Where a local client reaches a server bound to host:port (wildcard hosts → loopback)."""
    if host in ("0.0.0.0", ""):
        host = "127.0.0.1"
    elif host in ("::", "[::]"):
        host = "::1"
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"


def precision_line(dtype: str, **devices: str) -> str:
    """What `--dtype` means for each model, said on start: 'precision: int8 (auto on cpu) for …'."""
    parts = []
    for role, device in devices.items():
        resolved = resolve_precision(dtype, device)
        how = f"auto on {device}" if dtype == AUTO_PRECISION else "--dtype"
        parts.append(f"{role} {resolved} ({how})")
    return ("precision: " + ", ".join(parts) + "; the output is distributed exactly as the target model "
            "at its precision (--dtype float32 for the float32 model)")

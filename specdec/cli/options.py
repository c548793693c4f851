"""Option types shared by several commands (`serve *`, `up`, `generate`) and small parse helpers.

The observability options (--trace-file, --otlp-endpoint, --metrics-port, --metrics-host) live
in specdec.cli.observability with the rest of that set-up. The transport security options (--tls-*,
--auth-token-file, --engine-token-file, --token-file; docs/security.md) are here with
`server_security` / `client_security`, which check them before any model loads.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from specdec.cli import processes
from specdec.cli.common import fail
from specdec.defaults import (
    AUTO_PRECISION,
    DEFAULT_A,
    DEFAULT_K,
    DEFAULT_METHOD,
    DEFAULT_TREE_BUDGET,
    PRECISIONS,
    resolve_precision,
)
from specdec.methods import METHOD_NAMES
from specdec.runtime.batch_config import BATCH_LAYOUTS

if TYPE_CHECKING:  # grpc is imported only when a command runs
    from specdec.rpc.security import ClientSecurity, ServerSecurity

ModelOpt = Annotated[str, typer.Option("--model", "-m", help="Registry name or path (HF folder or .gguf).")]
HostOpt = Annotated[str, typer.Option("--host", help="Interface to listen on.")]
PortOpt = Annotated[int, typer.Option("--port", help="Port to listen on (0 = any free port).")]
PRECISION_CHOICES = (AUTO_PRECISION, *PRECISIONS)
_DEVICE = re.compile(r"(cpu|mps|cuda)(:(\d+))?")


def one_of(choices: tuple[str, ...]):
    """A parse-time check (a usage error, exit 2, before any model loads) that a value is a choice."""

    def check(value: str | None) -> str | None:
        if value is not None and value not in choices:
            raise typer.BadParameter(f"{value!r} is not one of {', '.join(choices)}")
        return value

    return check


def check_device(value: str | None) -> str | None:
    """A parse-time check of a torch device: its spelling (cpu, cuda, cuda:N, mps), and for an
    accelerator that torch can see it (torch is imported only then), before any model loads."""
    if value is None:
        return None
    match = _DEVICE.fullmatch(value)
    if match is None:
        raise typer.BadParameter(f"{value!r} is not a device: cpu, cuda, cuda:N or mps")
    kind, index = match.group(1), match.group(3)
    if kind == "cpu":
        return value
    import torch

    if kind == "mps":
        if not torch.backends.mps.is_available():
            raise typer.BadParameter("mps: no Apple GPU is available to this torch")
        return value
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
        raise typer.BadParameter(f"{value}: torch {torch.__version__} ({build}) sees no CUDA device")
    if index is not None and int(index) >= count:
        raise typer.BadParameter(f"{value}: torch sees {count} CUDA device(s), numbered from 0")
    return value


DeviceOpt = Annotated[str, typer.Option("--device", callback=check_device,
                                        help="torch device of the model: cpu, cuda, cuda:N or mps.")]
# The orchestrator's defaults of a request's knobs: one declaration each, for `serve orchestrator` and
# `up` alike; the values in the help come from specdec.defaults, where OrchestratorConfig takes them.
DefaultMethodOpt = Annotated[str | None, typer.Option(
    "--default-method", callback=one_of(METHOD_NAMES), help=(
        f"Method of requests that name none: {' | '.join(METHOD_NAMES)}. Default: "
        f"$SPECDEC_DEFAULT_METHOD, else {DEFAULT_METHOD}."), show_default=False)]
DefaultKOpt = Annotated[int | None, typer.Option(
    "--default-k", min=1, help=(
        "Draft length (token, block, ersd; RD's k_max) of requests without k; with --adaptive-k, where "
        "the online k of requests without a seed starts (gsd-tree's default is a tree budget of "
        f"{DEFAULT_TREE_BUDGET} nodes). Default: $SPECDEC_DEFAULT_K, else the pair's saved calibration "
        f"(`specdec analyze --save`), else {DEFAULT_K}."),
    show_default=False)]
DefaultAOpt = Annotated[float | None, typer.Option(
    "--default-a", min=0.0, max=1.0, help=(
        "RD drafting probability of requests without a. Default: $SPECDEC_DEFAULT_A, else the pair's "
        f"saved calibration (`specdec analyze --save`), else {DEFAULT_A:g}."), show_default=False)]


DtypeOpt = Annotated[str, typer.Option("--dtype", callback=one_of(PRECISION_CHOICES), help=(
    "Weights precision: auto | float32 | bfloat16 | float16 | int8. auto: the device's fast "
    "precision (int8 on a CPU, bfloat16 on a CUDA GPU, else float32). int8: int8 weights per "
    "channel, activations per row, attention in a fixed summation order (a C kernel built on "
    "first use; float64 attention without a C compiler or with SPECDEC_ATTENTION=float64), RMS "
    "norms and gated-MLP activations row by row in C (SPECDEC_LAYER_KERNELS=0: transformers') (CPU "
    "only; several times faster than float32 on CPUs without bf16 units). Batch-invariant, "
    "bitwise: int8 (a row's logits do not "
    "depend on the other rows of its pass). Not bitwise: float32 (~1e-5 in the logits), bfloat16 "
    "and float16. The output is distributed exactly as the target model at the chosen precision "
    "decoded one token per pass (docs/algorithms.md §14)."))]
ThreadsOpt = Annotated[int | None, typer.Option(
    "--threads", help="torch CPU threads. Default: the number of --cores, else torch's default.",
    show_default=False)]
CoresOpt = Annotated[str | None, typer.Option(
    "--cores", help="Pin this process to these CPU cores, e.g. 0 or 0,2-3 (os.sched_setaffinity). "
    "Default: no pinning.", show_default=False)]
MaxMessageOpt = Annotated[float, typer.Option("--max-message-mb", help="gRPC message size limit (MB).")]
# orchestrator.config.DraftRowsMode, spelled out: the CLI starts without pydantic (a test checks they agree).
DRAFT_ROWS_CHOICES = ("lean", "parked", "full")
DraftRowsOpt = Annotated[str | None, typer.Option(
    "--draft-rows", callback=one_of(DRAFT_ROWS_CHOICES), help=(
        "How the orchestrator sends the drafter's distributions to the verifier (docs/algorithms.md "
        "§12): lean | parked | full. lean: for token, rd and gsd-tree, each draft token's probability "
        "only, and a whole row of V floats only where the verifier asks for it after a rejection (one "
        "more round trip then); parked: lean, and the drafter keeps its rows too, sending them only when "
        "asked (fastest across hosts and GPUs; a drafter restart between a draft and its verify's "
        "rejection fails that request); full: every row (k + 1 rows of V float32) with every verify. "
        "The output is the same either way. Default: $SPECDEC_DRAFT_ROWS, else lean."),
    show_default=False)]
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
CudaGraphsOpt = Annotated[bool, typer.Option(
    "--cuda-graphs/--no-cuda-graphs", help=(
        "On a CUDA device: keep the sessions' KV caches in one preallocated pool and replay each pass "
        "as a CUDA graph captured at start (a pass costs its kernels, not ~35 Python launches a layer). "
        "Capture time and graph memory are logged at start. --no-cuda-graphs runs eager passes on "
        "growing caches (the CPU always does)."))]
KvSlotsOpt = Annotated[int, typer.Option(
    "--kv-slots", min=1, help="With --cuda-graphs: sessions the KV pool holds at once (more sessions get "
    "eager caches). The pool's memory is slots x slot tokens x the model's KV bytes per token.")]
KvSlotTokensOpt = Annotated[int, typer.Option(
    "--kv-slot-tokens", min=64, help="With --cuda-graphs: cache entries one pooled session holds (prompt, "
    "output and draft); a longer session moves to an eager cache.")]
MaxBatchTokensOpt = Annotated[int, typer.Option(
    "--max-batch-tokens", min=1, help="At most this many query rows in one batched pass: the calls' new "
    "tokens (ragged), or sessions x the widest call's (padded).")]
BatchLayoutOpt = Annotated[str, typer.Option(
    "--batch-layout", callback=one_of(BATCH_LAYOUTS), help=(
        "How a batched pass lays out its calls. ragged: their new tokens end to end, no padding, and a "
        "prompt's prefill chunks join other sessions' passes (one chunk a pass, so nobody's next token "
        "waits for a whole prompt). padded: every call padded to the widest, each prefill chunk in a pass "
        "of its own (the layout before ragged passes; also what eager attention gets)."))]
BatchWindowOpt = Annotated[float, typer.Option(
    "--batch-window-ms", min=0.0, max=1000.0, help="How long a pass waits for calls still on their way "
    "before it starts: calls holding a session, and sessions of the last two passes that have not queued "
    "again (a lone client never waits); longer where --batch-window-share says so.")]
BatchWindowShareOpt = Annotated[float, typer.Option(
    "--batch-window-share", min=0.0, max=1.0, help="The same wait as a share of the recent batched passes' "
    "mean time, where that is longer than --batch-window-ms: a call that misses a pass waits for the whole "
    "next one, so the wait that pays grows with the pass (0: --batch-window-ms alone).")]
PrefillChunkShareOpt = Annotated[float, typer.Option(
    "--prefill-chunk-share", min=0.0, max=16.0, help="While other sessions decode, a prompt's prefill chunk "
    "joins their pass (ragged layout) cut to add at most this share of a decode pass's time to it, both "
    "measured by the engine (at least 16 tokens): at 2, a pass with a chunk takes about three decode passes "
    "(8 clients: ITL p99 2.5-3x p50, first tokens about 6x sooner than at 1). Smaller: shorter gaps, much "
    "later first tokens under load. Alone, a prompt goes in whole chunks. 0: whole chunks always.")]
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
DEFAULT_PREFIX_CACHE_MB = 512.0
PrefixCacheOpt = Annotated[float, typer.Option(
    "--prefix-cache-mb", min=0.0, help=(
        "Memory for the prefix cache, per engine (MiB; 0 = off): KV entries of earlier prompts and answers, "
        "in blocks of 16 tokens, that a new session with the same beginning (a chat's next turn, an agent's "
        "next step, a shared system prompt) starts from instead of prefilling it. Least recently used "
        "blocks go first. Only requests of the same caller and cache_salt share blocks. At int8 a hit "
        "changes no output, not even a seeded one (docs/algorithms.md §16)."))]
AdmissionTimeoutOpt = Annotated[float, typer.Option(
    "--admission-timeout", min=0.0, help="Seconds a call that needs a new session waits for room while "
    "every session is busy and the KV budget or --max-sessions is full, before RESOURCE_EXHAUSTED.")]
# `up` with both models on the CPU: the draft model drafts while at most this many requests run. Its
# passes share the verifier's cores; on the 2-core EPYC, 4 clients on grounded prompts served 25.6
# tok/s with no draft model against 17.4 with it (bench/RESULTS.md, "Draft model under load").
UP_CPU_DRAFT_MODEL_MAX_REQUESTS = 1
DraftModelMaxRequestsOpt = Annotated[int | None, typer.Option(
    "--draft-model-max-requests", min=0, help=(
        "Hybrid drafting (the default source): the draft model drafts only while at most this many "
        "requests run at once; beyond, iterations use model-free drafts or target-only steps. Where "
        "the drafter shares the verifier's cores, its passes beside a busy verifier cost more than "
        "they save. 0: no limit. Seeded requests ignore it (replay). Default: "
        f"$SPECDEC_DRAFT_MODEL_MAX_REQUESTS, else 0 ({UP_CPU_DRAFT_MODEL_MAX_REQUESTS} under `up` with "
        "both models on the CPU)."), show_default=False)]
CloseChatTurnsOpt = Annotated[bool | None, typer.Option(
    "--close-chat-turns/--no-close-chat-turns", help=(
        "A chat request (messages) that ends while no other request runs passes the answer's last "
        "token and the chat template's end of its turn through the target in the background, so the "
        "conversation's next turn finds everything before its new message in the verifier's prefix "
        "cache and computes only that (docs/algorithms.md §16, \"The close of a chat turn\"). A request "
        "arriving meanwhile waits for at most that one pass of a few rows. Default: "
        "$SPECDEC_CLOSE_CHAT_TURNS, else on (`up` turns it off with --prefix-cache-mb 0)."),
    show_default=False)]
MaxActiveRequestsOpt = Annotated[int | None, typer.Option(
    "--max-active-requests", min=1, help=(
        "Requests the orchestrator runs at once; later ones wait in arrival order for up to "
        "--queue-timeout, then get RESOURCE_EXHAUSTED. Default: $SPECDEC_MAX_ACTIVE_REQUESTS, else "
        f"{DEFAULT_MAX_ACTIVE_REQUESTS}."), show_default=False)]
QueueTimeoutOpt = Annotated[float | None, typer.Option(
    "--queue-timeout", min=0.0, help=(
        "Seconds a request waits for one of the --max-active-requests slots before RESOURCE_EXHAUSTED. "
        f"Default: $SPECDEC_QUEUE_TIMEOUT_S, else {DEFAULT_QUEUE_TIMEOUT_S:g}."), show_default=False)]
RequestTtlOpt = Annotated[int | None, typer.Option(
    "--request-ttl", min=1, help=(
        "Seconds a request's stored record (its progress, for Resume) is kept after its last update. "
        "Default: $SPECDEC_REQUEST_TTL_SECONDS, else 86400."), show_default=False)]
StoreTimeoutOpt = Annotated[float | None, typer.Option(
    "--store-timeout", min=0.01, help=(
        "Seconds one operation on the request store (Redis) may take as a whole, connecting included; a "
        "hung or unreachable Redis fails a new request with UNAVAILABLE after this long instead of "
        "stalling it. Default: $SPECDEC_STORE_TIMEOUT_S, else 2."), show_default=False)]
StoreOutageGraceOpt = Annotated[float | None, typer.Option(
    "--store-outage-grace", min=0.0, help=(
        "Seconds a running request generates on while its progress cannot be saved (its chunks held back "
        "until a save succeeds); after that it ends UNAVAILABLE, resumable from its last saved progress. "
        "0: end at the first failed save. Default: $SPECDEC_STORE_OUTAGE_GRACE_S, else 30."),
    show_default=False)]
MaxRequestsPerCallerOpt = Annotated[int | None, typer.Option(
    "--max-requests-per-caller", min=0, help=(
        "Requests one caller may have open at once (running, queued or paused), counted by its bearer "
        "token or client certificate, else by its address; more get RESOURCE_EXHAUSTED (HTTP 429) at "
        "once. 0: no cap, since anonymous clients behind one address (a proxy, a NAT, loopback) share "
        "it. Default: $SPECDEC_MAX_REQUESTS_PER_CALLER, else 0."), show_default=False)]
StreamIdleTimeoutOpt = Annotated[float | None, typer.Option(
    "--stream-idle-timeout", min=0.0, help=(
        "Seconds a streamed response (gRPC or SSE) may go unread: a run whose client has not taken its "
        "last chunk pauses and gives its request slot to others at once; after this long without a "
        "chunk taken it is closed (its sessions freed; Resume continues it exactly): a gRPC client gets "
        "RESOURCE_EXHAUSTED when it reads on, an HTTP connection is closed 5 s later. 0: paused streams "
        "are never closed. Default: "
        "$SPECDEC_STREAM_IDLE_TIMEOUT_S, else 30."), show_default=False)]
MaxPromptBytesOpt = Annotated[int | None, typer.Option(
    "--max-prompt-bytes", min=1, help=(
        "Largest prompt text (UTF-8 bytes) a request may send; a larger one gets INVALID_ARGUMENT before "
        "anything tokenizes it. Default: $SPECDEC_MAX_PROMPT_BYTES, else 2 MiB."), show_default=False)]
HttpPortOpt = Annotated[int | None, typer.Option(
    "--http-port", min=0, max=65535, help=(
        "Also serve the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /v1/models, "
        "/health; docs/http.md) on this port of --host (0 = any free port), with the same TLS and token "
        "as the gRPC port. Default: off."), show_default=False)]
ServedModelNameOpt = Annotated[str | None, typer.Option(
    "--served-model-name", help="The model id of the HTTP API (/v1/models, the `model` of requests and "
    "responses) and of the metrics' model label. Default: the target model's id.", show_default=False)]
ChatTemplateOpt = Annotated[Path | None, typer.Option(
    "--chat-template", exists=True, dir_okay=False, readable=True, help=(
        "A Jinja chat template file used for chats instead of the target tokenizer's own (a model "
        "without one refuses chats: 400 / INVALID_ARGUMENT)."), show_default=False)]
ReadyFileOpt = Annotated[Path | None, typer.Option(
    "--ready-file", help="Once serving, write JSON {address, host, port, pid, ...} to this file.",
    show_default=False)]
LogLevelOpt = Annotated[str, typer.Option("--log-level", help="Python logging level.")]

# ------------------------------------------------------------------ transport security (docs/security.md)
TOKEN_ENV = "SPECDEC_TOKEN"
_TOKEN_HINT = "one line, e.g. from `openssl rand -base64 32`; keep it chmod 600"
TlsCertOpt = Annotated[Path | None, typer.Option(
    "--tls-cert", help="Serve TLS with this PEM certificate (chain); needs --tls-key. Default: plaintext.",
    show_default=False)]
TlsKeyOpt = Annotated[Path | None, typer.Option(
    "--tls-key", help="The unencrypted PEM private key of --tls-cert (keep it chmod 600).",
    show_default=False)]
TlsClientCaOpt = Annotated[Path | None, typer.Option(
    "--tls-client-ca", help="mTLS: PEM CA certificate(s) that sign the client certificates this server "
    "accepts; with --tls-require-client-cert.", show_default=False)]
TlsRequireClientCertOpt = Annotated[bool, typer.Option(
    "--tls-require-client-cert", help="mTLS: refuse every client (health checks included) that does not "
    "present a certificate signed by --tls-client-ca; needs --tls-cert.")]


def _tls_ca_opt(peer: str) -> Any:
    return Annotated[Path | None, typer.Option(
        "--tls-ca", help=f"Connect to {peer} with TLS, verifying the server certificate with this PEM CA "
        "certificate (e.g. your own CA). Default: plaintext.", show_default=False)]


def _tls_client_cert_opt(peer: str) -> Any:
    return Annotated[Path | None, typer.Option(
        "--tls-client-cert", help=f"mTLS: present this PEM client certificate to {peer} (signed by the "
        "CA of the server's --tls-client-ca); needs --tls-client-key.", show_default=False)]


TlsClientKeyOpt = Annotated[Path | None, typer.Option(
    "--tls-client-key", help="The unencrypted PEM private key of --tls-client-cert.", show_default=False)]
TlsServerNameOpt = Annotated[str | None, typer.Option(
    "--tls-server-name", help="Expect this name in the server's certificate instead of the host of the "
    "address (e.g. when connecting by IP to a certificate issued for a DNS name).", show_default=False)]
TlsCaOpt = _tls_ca_opt("the orchestrator")
TlsClientCertOpt = _tls_client_cert_opt("the orchestrator")
EngineTlsCaOpt = _tls_ca_opt("the drafter and the verifier")
EngineTlsClientCertOpt = _tls_client_cert_opt("the drafter and the verifier")
AuthTokenFileOpt = Annotated[Path | None, typer.Option(
    "--auth-token-file", help="Clients must send `authorization: Bearer <token>` with the token in this "
    f"file ({_TOKEN_HINT}); a missing or wrong token gets UNAUTHENTICATED. Health checks stay open. "
    "Default: no token.", show_default=False)]
TenantsFileOpt = Annotated[Path | None, typer.Option(
    "--tenants-file", help="Tenants: lines `NAME TOKEN` (or `NAME cn:COMMON_NAME` for a client certificate, "
    "mTLS). Every token is accepted besides --auth-token-file's, and its caller is tenant NAME: its stored "
    "requests, its --max-requests-per-caller cap and its share of the prefix and suffix caches are the "
    "tenant's. Default: no tenants.", show_default=False)]
EngineAuthTokenFileOpt = Annotated[Path | None, typer.Option(
    "--auth-token-file", help="Accept only callers sending this token as `authorization: Bearer <token>` "
    f"(the orchestrator's --engine-token-file; {_TOKEN_HINT}); others get UNAUTHENTICATED on every RPC but "
    "health. `specdec up` makes one for its engines. Default: no token.", show_default=False)]
InsecureEngineOpt = Annotated[bool, typer.Option(
    "--insecure-engine", help="Serve on a non-loopback --host without --auth-token-file or mTLS "
    "(--tls-require-client-cert): anyone who reaches the port may run every RPC, chat templates included. "
    "Without this flag such a start is refused; loopback hosts never need it.")]
MaxChatTemplateKbOpt = Annotated[int, typer.Option(
    "--max-chat-template-kb", min=1, help="Verifier: the largest chat template a caller may send with "
    "ApplyChatTemplate (the orchestrator's --chat-template); larger ones get INVALID_ARGUMENT unread. The "
    "model's own template is not limited.")]
ChatTemplateTimeoutOpt = Annotated[float, typer.Option(
    "--chat-template-timeout", min=0.01, help="Verifier: seconds a caller's chat template may render. It "
    "renders in a child process (capped at 512 MB and a 4 MiB prompt) that is killed past this time; the "
    "call gets INVALID_ARGUMENT and Tokenize, Verify and other calls are served meanwhile.")]
EngineTokenFileOpt = Annotated[Path | None, typer.Option(
    "--engine-token-file", help="Send the token in this file to the drafter and the verifier (their "
    "--auth-token-file). Default: none.", show_default=False)]
TokenFileOpt = Annotated[Path | None, typer.Option(
    "--token-file", help="Send the token in this file to the orchestrator (its --auth-token-file). "
    f"Default: ${TOKEN_ENV}, else none.", show_default=False)]


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


def server_security(*, tls_cert: Path | None, tls_key: Path | None, tls_client_ca: Path | None,
                    tls_require_client_cert: bool, auth_token_file: Path | None,
                    tenants_file: Path | None = None) -> ServerSecurity:
    """A server's --tls-*, --auth-token-file and --tenants-file, checked now, before any model loads: a
    bad combination exits 2, a missing or bad file exits 1, each with one line naming the flag."""
    from specdec.rpc.security import ServerSecurity, read_token_file
    from specdec.rpc.tenants import read_tenants_file

    try:
        ServerSecurity(tls_cert, tls_key, tls_client_ca, tls_require_client_cert)
    except ValueError as exc:
        raise fail(str(exc), 2) from None
    try:
        tokens = (read_token_file(auth_token_file, "--auth-token-file"),) if auth_token_file else ()
        tenants = read_tenants_file(tenants_file) if tenants_file is not None else None
        if tenants is not None:
            tokens += tenants.tokens
        security = ServerSecurity(absolute_path(tls_cert), absolute_path(tls_key),
                                  absolute_path(tls_client_ca), tls_require_client_cert, tokens, tenants)
        _ = security.credentials  # reads and checks the files
    except ValueError as exc:
        raise fail(str(exc)) from None
    return security


def refuse_open_engine(role: str, host: str, security: ServerSecurity, insecure_engine: bool) -> None:
    """Exit 2 with one line when an engine would serve a non-loopback address with nobody proven:
    no --auth-token-file and no required client certificates, and no explicit --insecure-engine.
    An open engine runs any caller's chat template and reads any session (issue 29)."""
    from specdec.rpc.security import is_loopback

    if insecure_engine or security.authenticated or is_loopback(host):
        return
    raise fail(f"{role}: --host {host or '(all interfaces)'} is not a loopback address and the {role} has "
               "no --auth-token-file and no mTLS (--tls-require-client-cert), so anyone who reaches the port "
               "could run its RPCs; add --auth-token-file FILE (the orchestrator's --engine-token-file), "
               "bind --host 127.0.0.1, or pass --insecure-engine to serve it open anyway", 2)


def client_security(*, tls_ca: Path | None, tls_client_cert: Path | None, tls_client_key: Path | None,
                    tls_server_name: str | None = None, token_file: Path | None = None,
                    token_flag: str = "--token-file", token_env: str | None = None) -> ClientSecurity:
    """A client's --tls-ca / --tls-client-cert / --tls-client-key / --tls-server-name and token (from
    `token_file`, else the variable `token_env`), checked like server_security."""
    from specdec.rpc.security import ClientSecurity, read_token_file

    try:
        ClientSecurity(tls_ca, tls_client_cert, tls_client_key, server_name=tls_server_name)
    except ValueError as exc:
        raise fail(str(exc), 2) from None
    try:
        token = read_token_file(token_file, token_flag) if token_file is not None else None
        if token is None and token_env is not None:
            token = os.environ.get(token_env, "").strip() or None
            if token is not None and any(ch.isspace() or not ch.isprintable() or not ch.isascii()
                                         for ch in token):
                raise ValueError(f"${token_env}: a token must be one word of printable ASCII")
        security = ClientSecurity(absolute_path(tls_ca), absolute_path(tls_client_cert),
                                  absolute_path(tls_client_key), token=token, server_name=tls_server_name)
        _ = security.credentials  # reads and checks the files
    except ValueError as exc:
        raise fail(str(exc)) from None
    return security


def absolute_path(path: Path | None) -> Path | None:
    """A path as given on the command line, made absolute (`up` hands paths to its children)."""
    return None if path is None else path.expanduser().absolute()

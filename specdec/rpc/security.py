"""Transport security of the gRPC services: TLS / mTLS credentials, bearer tokens (checked by servers,
sent by clients), who is calling, and a warning when a server is reachable from outside unprotected.

Identities are one-way digests, so a stored record never holds a secret and a log line naming an
identity reveals nothing usable. Tokens never appear in a log line, an error message or a repr.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import ipaddress
import logging
import os
import ssl
import stat
import time
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from specdec.defaults import ANONYMOUS
from specdec.rpc.refusal import refusing

log = logging.getLogger(__name__)

AUTHORIZATION_HEADER = "authorization"
BEARER_PREFIX = "bearer "
UNAUTHENTICATED_MESSAGE = "missing or invalid bearer token"
# Open without a token: Kubernetes and `specdec up` probe health, and a probe carries no secret.
HEALTH_PREFIX = "/grpc.health.v1.Health/"
REJECTION_LOG_INTERVAL_S = 10.0


def bearer_token(metadata: Any) -> str | None:
    """The token of an `authorization: Bearer <token>` entry in a call's metadata, if any."""
    for key, value in metadata or ():
        if key.lower() == AUTHORIZATION_HEADER:
            text = value.decode(errors="replace") if isinstance(value, bytes) else str(value)
            if text.lower().startswith(BEARER_PREFIX):
                return text[len(BEARER_PREFIX):].strip() or None
    return None


def digest(secret: str | bytes) -> str:
    data = secret.encode() if isinstance(secret, str) else secret
    return hashlib.sha256(data).hexdigest()[:24]


def caller_identity(context: Any) -> str:
    """The caller of a grpc.aio call: "token:<digest>", else "cert:<digest>" of its verified client
    certificate (mTLS), else ANONYMOUS (a plaintext or server-only-TLS caller without a token)."""
    token = bearer_token(context.invocation_metadata())
    if token is not None:
        return f"token:{digest(token)}"
    try:
        auth = context.auth_context() or {}
    except Exception:  # noqa: BLE001 - not every context implements it
        auth = {}
    certs = auth.get("x509_pem_cert") or []
    if certs:
        return f"cert:{digest(certs[0])}"
    return ANONYMOUS


# ------------------------------------------------------------------------------ files


def _read_file(path: Path | str, flag: str) -> bytes:
    """The bytes of a file named by `flag`; ValueError naming the flag and the path when unreadable."""
    path = Path(path).expanduser()
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise ValueError(f"{flag} {path}: no such file") from None
    except IsADirectoryError:
        raise ValueError(f"{flag} {path}: is a directory, not a file") from None
    except OSError as exc:
        raise ValueError(f"{flag} {path}: cannot read it ({exc.strerror or exc})") from None


def _read_pem(path: Path | str, flag: str, what: str) -> bytes:
    """A PEM file holding at least one `what` block (CERTIFICATE, PRIVATE KEY)."""
    data = _read_file(path, flag)
    if b"-----BEGIN " not in data or what.encode() not in data:
        raise ValueError(f"{flag} {Path(path).expanduser()}: not a PEM file with a {what.lower()} "
                         f"(expected a '-----BEGIN ...{what}-----' block)")
    return data


def _no_password() -> bytes:
    raise ValueError("encrypted private keys are not supported; decrypt it first "
                     "(openssl pkey -in KEY -out KEY.plain)")


def _check_pair(cert: Path, key: Path, cert_flag: str, key_flag: str) -> None:
    """Catch a key that does not belong to its certificate (or a bad PEM) here, with the flag names,
    instead of as an obscure handshake failure later (the standard library parses both)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(str(Path(cert).expanduser()), str(Path(key).expanduser()),
                                password=_no_password)
    except ValueError as exc:
        raise ValueError(f"{key_flag} {Path(key).expanduser()}: {exc}") from None
    except ssl.SSLError as exc:
        reason = exc.reason or str(exc)
        if "KEY_VALUES_MISMATCH" in str(exc).upper():
            raise ValueError(f"{key_flag} {Path(key).expanduser()} is not the private key of {cert_flag} "
                             f"{Path(cert).expanduser()}") from None
        raise ValueError(f"{cert_flag} {Path(cert).expanduser()} / {key_flag} {Path(key).expanduser()}: "
                         f"cannot load this certificate and key ({reason})") from None


def _check_ca(path: Path, flag: str) -> None:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        context.load_verify_locations(cafile=str(Path(path).expanduser()))
    except ssl.SSLError as exc:
        raise ValueError(f"{flag} {Path(path).expanduser()}: not a valid PEM CA certificate "
                         f"({exc.reason or exc})") from None


def _check_server_flags(cert: Path | None, key: Path | None, client_ca: Path | None,
                        require_client_cert: bool) -> None:
    """ValueError naming the flags of an inconsistent combination (checked before any file is read)."""
    if (cert is None) != (key is None):
        raise ValueError("--tls-cert needs --tls-key" if key is None else "--tls-key needs --tls-cert")
    if cert is None and (client_ca is not None or require_client_cert):
        flag = "--tls-client-ca" if client_ca is not None else "--tls-require-client-cert"
        raise ValueError(f"{flag} needs --tls-cert and --tls-key (mTLS runs over TLS)")
    if require_client_cert and client_ca is None:
        raise ValueError("--tls-require-client-cert needs --tls-client-ca (the CA that signs the client "
                         "certificates)")
    if client_ca is not None and not require_client_cert:
        raise ValueError("--tls-client-ca needs --tls-require-client-cert (gRPC checks client "
                         "certificates only when it requires them)")


def server_credentials(cert: Path, key: Path, client_ca: Path | None = None,
                       require_client_cert: bool = False) -> grpc.ServerCredentials:
    """TLS credentials of a server (--tls-cert, --tls-key); with `require_client_cert`, mTLS: only
    clients presenting a certificate signed by `client_ca` (--tls-client-ca) complete the handshake.

    ValueError naming the flag for a missing, unreadable or non-PEM file, a key that is not the
    certificate's, or an inconsistent combination.
    """
    _check_server_flags(cert, key, client_ca, require_client_cert)
    cert_pem = _read_pem(cert, "--tls-cert", "CERTIFICATE")
    key_pem = _read_pem(key, "--tls-key", "PRIVATE KEY")
    _check_pair(cert, key, "--tls-cert", "--tls-key")
    ca_pem = None
    if client_ca is not None:
        ca_pem = _read_pem(client_ca, "--tls-client-ca", "CERTIFICATE")
        _check_ca(client_ca, "--tls-client-ca")
    return grpc.ssl_server_credentials([(key_pem, cert_pem)], root_certificates=ca_pem,
                                       require_client_auth=require_client_cert)


def _check_client_pair(client_cert: Path | None, client_key: Path | None) -> None:
    if (client_cert is None) != (client_key is None):
        raise ValueError("--tls-client-cert needs --tls-client-key" if client_key is None
                         else "--tls-client-key needs --tls-client-cert")


def channel_credentials(ca: Path | None = None, client_cert: Path | None = None,
                        client_key: Path | None = None) -> grpc.ChannelCredentials:
    """TLS credentials of a client channel: verify the server with `ca` (--tls-ca; None: the system's
    roots) and, for mTLS, present `client_cert` / `client_key` (--tls-client-cert, --tls-client-key)."""
    _check_client_pair(client_cert, client_key)
    ca_pem = None
    if ca is not None:
        ca_pem = _read_pem(ca, "--tls-ca", "CERTIFICATE")
        _check_ca(ca, "--tls-ca")
    cert_pem = key_pem = None
    if client_cert is not None and client_key is not None:
        cert_pem = _read_pem(client_cert, "--tls-client-cert", "CERTIFICATE")
        key_pem = _read_pem(client_key, "--tls-client-key", "PRIVATE KEY")
        _check_pair(client_cert, client_key, "--tls-client-cert", "--tls-client-key")
    return grpc.ssl_channel_credentials(root_certificates=ca_pem, private_key=key_pem,
                                        certificate_chain=cert_pem)


def read_token_file(path: Path | str, flag: str = "--auth-token-file") -> str:
    """The bearer token in a file (surrounding whitespace stripped). ValueError naming the flag when
    the file is missing, empty or holds what an HTTP/2 header cannot carry; never quotes the token."""
    data = _read_file(path, flag)
    try:
        token = data.decode("ascii").strip()
    except UnicodeDecodeError:
        token = None
    path = Path(path).expanduser()
    if token == "":
        raise ValueError(f"{flag} {path}: the file is empty (expected one token, e.g. from "
                         "`openssl rand -base64 32`)")
    if token is None or any(ch.isspace() or not ch.isprintable() for ch in token):
        raise ValueError(f"{flag} {path}: a token must be one word of printable ASCII (e.g. from "
                         "`openssl rand -base64 32`)")
    try:
        mode = path.stat().st_mode
    except OSError:
        mode = 0
    # Group access is allowed: a Kubernetes Secret volume gives its files to the pod's fsGroup (0440).
    if mode & stat.S_IRWXO:
        log.warning("%s %s can be read by every user of this machine; chmod 600 (or 640) it", flag, path)
    return token


def write_token_file(path: Path, token: str) -> Path:
    """Write a token to a new file only its owner can read (0600), replacing an older one."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(token + "\n")
    return path


# ------------------------------------------------------------------------------ server side


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """Lets through only calls carrying `authorization: Bearer <one of tokens>`; any other call gets
    UNAUTHENTICATED before its request is parsed. Methods under an `exempt` prefix (health) stay open.

    Tokens are compared in constant time against every accepted token (several allow a rotation).
    Rejections are logged without the token, at most one line per REJECTION_LOG_INTERVAL_S.
    """

    def __init__(self, tokens: Collection[str], exempt: Sequence[str] = (HEALTH_PREFIX,)) -> None:
        if not tokens or any(not token for token in tokens):
            raise ValueError("TokenAuthInterceptor needs at least one non-empty token")
        self._tokens = tuple(token.encode() for token in tokens)
        self._exempt = tuple(exempt)
        self._rejected = 0
        self._last_log = float("-inf")

    def accepts(self, token: str | None) -> bool:
        if token is None:
            return False
        given = token.encode(errors="replace")
        ok = False
        for accepted in self._tokens:  # no early exit: the time does not tell which token matched
            ok |= hmac.compare_digest(given, accepted)
        return ok

    async def intercept_service(self, continuation: Any, details: grpc.HandlerCallDetails) -> Any:
        method = details.method or ""
        if method.startswith(self._exempt) or self.accepts(bearer_token(details.invocation_metadata)):
            return await continuation(details)
        handler = await continuation(details)
        if handler is None:  # unknown method: UNIMPLEMENTED, as without the interceptor
            return None
        self._note_rejection(method)
        return refusing(handler, grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)

    def _note_rejection(self, method: str) -> None:
        self._rejected += 1
        now = time.monotonic()
        if now - self._last_log >= REJECTION_LOG_INTERVAL_S:
            log.warning("refused %d call(s) without a valid bearer token (UNAUTHENTICATED; last: %s)",
                        self._rejected, method)
            self._rejected = 0
            self._last_log = now


@dataclass(frozen=True)
class ServerSecurity:
    """How a server protects its port: TLS (cert + key), mTLS (client CA, required client
    certificates) and bearer tokens. The default is plaintext and open (loopback development)."""

    cert: Path | None = None
    key: Path | None = None
    client_ca: Path | None = None
    require_client_cert: bool = False
    tokens: tuple[str, ...] = field(default=(), repr=False)
    tenants: Any = field(default=None, repr=False)  # specdec.rpc.tenants.Tenants: callers' tenant names

    def __post_init__(self) -> None:
        _check_server_flags(self.cert, self.key, self.client_ca, self.require_client_cert)

    @property
    def tls(self) -> bool:
        return self.cert is not None

    @property
    def authenticated(self) -> bool:
        """Whether every caller must prove who it is (a bearer token or a verified client certificate)."""
        return bool(self.tokens) or self.require_client_cert

    @functools.cached_property
    def credentials(self) -> grpc.ServerCredentials | None:
        """For start_*_server(credentials=...): None = plaintext. Reads and checks the files (ValueError)."""
        if self.cert is None or self.key is None:
            return None
        return server_credentials(self.cert, self.key, self.client_ca, self.require_client_cert)

    def interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        """Put first among a server's interceptors: refused calls cost nothing further."""
        return [TokenAuthInterceptor(self.tokens)] if self.tokens else []


# ------------------------------------------------------------------------------ client side


class _AddsBearerToken:
    """Adds `authorization: Bearer <token>` to every call's metadata (works on plaintext channels,
    where grpc's call credentials refuse to send anything)."""

    def __init__(self, token: str) -> None:
        self._value = f"Bearer {token}"

    def __repr__(self) -> str:
        return f"{type(self).__name__}(<token>)"

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*((key, value) for key, value in (details.metadata or ())
                                       if key.lower() != AUTHORIZATION_HEADER))
        metadata.add(AUTHORIZATION_HEADER, self._value)
        return details._replace(metadata=metadata)


class _UnaryUnaryToken(_AddsBearerToken, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(self._details(client_call_details), request)


class _UnaryStreamToken(_AddsBearerToken, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(self._details(client_call_details), request)


class _StreamUnaryToken(_AddsBearerToken, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return await continuation(self._details(client_call_details), request_iterator)


class _StreamStreamToken(_AddsBearerToken, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return await continuation(self._details(client_call_details), request_iterator)


def token_interceptors(token: str) -> list[grpc.aio.ClientInterceptor]:
    """grpc.aio client interceptors sending `token` with every call (one per call kind: a grpc.aio
    channel files each interceptor under one kind only)."""
    return [kind(token) for kind in (_UnaryUnaryToken, _UnaryStreamToken, _StreamUnaryToken,
                                     _StreamStreamToken)]


@dataclass(frozen=True)
class ClientSecurity:
    """How a client reaches a server: TLS when any TLS file is given (or `tls`), verifying the server
    with `tls_ca` (else the system's roots), presenting `client_cert` / `client_key` for mTLS, expecting
    `server_name` in the server's certificate (else the address's host), sending `token` as a bearer
    token. The default is plaintext without a token."""

    tls_ca: Path | None = None
    client_cert: Path | None = None
    client_key: Path | None = None
    token: str | None = field(default=None, repr=False)
    server_name: str | None = None
    tls: bool = False

    def __post_init__(self) -> None:
        _check_client_pair(self.client_cert, self.client_key)
        if self.server_name is not None and not self.uses_tls:
            raise ValueError("--tls-server-name needs --tls-ca (it names the server in a TLS certificate)")
        if self.token is not None and not self.token:
            raise ValueError("the bearer token is empty")

    @property
    def uses_tls(self) -> bool:
        return self.tls or self.tls_ca is not None or self.client_cert is not None

    @functools.cached_property
    def credentials(self) -> grpc.ChannelCredentials | None:
        """None for plaintext; reads and checks the files once (ValueError naming the flag)."""
        if not self.uses_tls:
            return None
        return channel_credentials(self.tls_ca, self.client_cert, self.client_key)

    def options(self) -> list[tuple[str, Any]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []

    def interceptors(self) -> list[grpc.aio.ClientInterceptor]:
        return token_interceptors(self.token) if self.token else []

    def channel(self, address: str, options: Iterable[tuple[str, Any]] = (),
                interceptors: Iterable[Any] = ()) -> grpc.aio.Channel:
        """A grpc.aio channel to `address`: secure when TLS is configured, with the token interceptors
        before `interceptors`."""
        chained = [*self.interceptors(), *interceptors] or None
        opts = [*options, *self.options()]
        credentials = self.credentials
        if credentials is None:
            return grpc.aio.insecure_channel(address, options=opts, interceptors=chained)
        return grpc.aio.secure_channel(address, credentials, options=opts, interceptors=chained)

    def sync_channel(self, address: str, options: Iterable[tuple[str, Any]] = ()) -> grpc.Channel:
        """A blocking channel (`specdec up`'s health probes): TLS as configured, no token (health is open)."""
        opts = [*options, *self.options()]
        credentials = self.credentials
        if credentials is None:
            return grpc.insecure_channel(address, options=opts)
        return grpc.secure_channel(address, credentials, options=opts)


# ------------------------------------------------------------------------------ exposure


def is_loopback(host: str) -> bool:
    """Whether a bind address only accepts connections from this machine (127.0.0.0/8, ::1,
    localhost). Wildcards (0.0.0.0, ::, ""), other addresses and other host names are not."""
    name = host.strip().strip("[]").lower()
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def exposure_warning(host: str, *, tls: bool, token: bool, role: str) -> str | None:
    """The warning for a server of `role` bound to `host` without TLS or without authentication
    (`token`: callers must present a bearer token or a verified client certificate); None when the
    address is loopback or both are on."""
    if is_loopback(host) or (tls and token):
        return None
    engine = role in ("drafter", "verifier")
    what = ("the engine RPCs (Draft, Lookahead, Release, Tokenize, …)" if engine
            else "Generate (over gRPC, and the HTTP API's completions with --http-port), and reach "
            "every request stored without a token (Resume)")
    where = host or "all interfaces"
    missing, fixes = [], []
    if not token:
        missing.append("authentication")
        fixes.append("--auth-token-file" + (" (or --tls-client-ca with --tls-require-client-cert)"
                                            if engine else ""))
    if not tls:
        missing.append("TLS")
        fixes.append("--tls-cert/--tls-key")
    consequence = (f"anyone who can reach this port can call {what}" if not token
                   else "tokens, prompts and outputs cross the network in plaintext")
    return (f"{role} exposed on {where} (not a loopback address) without {' or '.join(missing)}: "
            f"{consequence}; add {' and '.join(fixes)}, or bind --host 127.0.0.1")


def warn_if_exposed(host: str, *, tls: bool, token: bool, role: str,
                    logger: logging.Logger | None = None) -> str | None:
    """Log exposure_warning's line (once, at WARNING) when there is one; returns it."""
    message = exposure_warning(host, tls=tls, token=token, role=role)
    if message is not None:
        (logger or log).warning("%s", message)
    return message

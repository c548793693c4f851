"""A protected /metrics endpoint: a bearer token, TLS, or both (--metrics-token-file, --metrics-tls).

prometheus-client's own server has TLS but no token, and does the TLS handshake in its accepting
thread (one silent client stalls every scrape). This one answers 401 without the token, does each
handshake in the connection's own thread under a timeout, and logs nothing per request. It has the
interface of orchestrator.metrics.MetricsServer (port, url, close), so callers need not care which
one runs; an unprotected endpoint keeps using orchestrator.metrics.start_metrics_server.
"""

from __future__ import annotations

import hmac
import logging
import socket
import ssl
import threading
from dataclasses import dataclass
from pathlib import Path
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

log = logging.getLogger(__name__)

# A client gets this long for its TLS handshake and each read (a stuck one holds only its own thread).
CONNECTION_TIMEOUT_S = 10.0


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        """No line per scrape."""


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True
    ssl_context: ssl.SSLContext | None = None

    def finish_request(self, request: Any, client_address: Any) -> None:
        """Runs in the connection's thread: the TLS handshake happens here, not in the accept loop."""
        request.settimeout(CONNECTION_TIMEOUT_S)
        if self.ssl_context is not None:
            request = self.ssl_context.wrap_socket(request, server_side=True)
        super().finish_request(request, client_address)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A failed handshake or a dropped client is one debug line, not a traceback on stderr."""
        log.debug("metrics: connection from %s failed", client_address, exc_info=True)


class _Server6(_Server):
    address_family = socket.AF_INET6


def bearer_guard(app: Any, token: str) -> Any:
    """WSGI middleware: 401 unless the request carries `Authorization: Bearer <token>`."""
    expected = f"Bearer {token}".encode()

    def guarded(environ: dict[str, Any], start_response: Any) -> Any:
        given = environ.get("HTTP_AUTHORIZATION", "").encode("latin-1", "replace")
        if not hmac.compare_digest(given, expected):
            start_response("401 Unauthorized", [("Content-Type", "text/plain; charset=utf-8"),
                                                ("WWW-Authenticate", 'Bearer realm="metrics"')])
            return [b"401 Unauthorized: /metrics needs the token of --metrics-token-file as a bearer token\n"]
        return app(environ, start_response)

    return guarded


@dataclass
class ProtectedMetricsServer:
    """A running protected /metrics endpoint (a daemon thread serving `server`)."""

    server: Any
    thread: threading.Thread
    host: str
    port: int
    tls: bool

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'https' if self.tls else 'http'}://{host}:{self.port}/metrics"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


def start_protected_metrics_server(port: int, host: str, registry: Any, *, token: str | None = None,
                                   certfile: Path | str | None = None,
                                   keyfile: Path | str | None = None) -> ProtectedMetricsServer:
    """Serve `registry` on host:port/metrics, asking for `token` and/or speaking TLS with the PEM
    cert and key (port 0 = any free port). OSError when the port is taken; ValueError for bad files."""
    from prometheus_client import make_wsgi_app

    if token is None and certfile is None:
        raise ValueError("a protected metrics endpoint needs a token or a certificate")
    context = None
    if certfile is not None:
        if keyfile is None:
            raise ValueError("--metrics-tls needs the key of --tls-cert (--tls-key)")
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            context.load_cert_chain(str(certfile), str(keyfile))
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"--metrics-tls: cannot load {certfile} / {keyfile}: {exc}") from None
    app = make_wsgi_app(registry)
    if token is not None:
        app = bearer_guard(app, token)
    server_class = _Server6 if ":" in host else _Server
    server = make_server(host.strip("[]"), port, app, server_class=server_class, handler_class=_QuietHandler)
    server.ssl_context = context
    thread = threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True)
    thread.start()
    return ProtectedMetricsServer(server, thread, host, int(server.server_address[1]), context is not None)

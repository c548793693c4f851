"""How much of what the HTTP door wrote to a client the client has not read yet.

A streamed response is written into the connection's buffers (the event loop's, then the kernel's
send queue), so a client that stops reading is seen by a blocked write only once those are full: a
few hundred kB of server-sent events, minutes of generation for a slow model, during which its runs
keep their request slots (orchestrator.admission.paced). The door instead waits before each event
until the connection's unsent bytes (SIOCOUTQ: queued in the kernel and not yet acknowledged, plus
the event loop's buffer) are below UNREAD_LIMIT_BYTES, so an unread stream stops pulling chunks
after a few events and its runs pause. A reading client drains the queue within a round trip; the
limit caps a stream's throughput at UNREAD_LIMIT_BYTES per round trip (320 kB/s at 100 ms), far above
what token streams send.

The uvicorn protocol (UnreadAwareH11) registers each connection's transport under the client's
address, which ASGI gives the app as scope["client"]. The same lookup gives the door the client
certificate the TLS handshake verified (mTLS), which ASGI does not pass on: its identity and common
name map the caller to a tenant, as on the gRPC door (specdec.rpc.tenants).
"""

from __future__ import annotations

import asyncio
import fcntl
import ssl
import struct
import termios
from dataclasses import dataclass
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

UNREAD_LIMIT_BYTES = 32 * 1024
POLL_S = 0.02

_TRANSPORTS: dict[tuple[str, int], asyncio.BaseTransport] = {}


def _address(transport: asyncio.BaseTransport) -> tuple[str, int] | None:
    peer = transport.get_extra_info("peername")
    if isinstance(peer, (tuple, list)) and len(peer) >= 2:
        return str(peer[0]), int(peer[1])
    return None


class UnreadAwareH11(H11Protocol):
    """uvicorn's h11 protocol, with its transport findable by the client's address."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:  # type: ignore[override]
        super().connection_made(transport)  # type: ignore[arg-type]
        address = _address(transport)
        if address is not None:
            _TRANSPORTS[address] = transport

    def connection_lost(self, exc: Exception | None) -> None:
        address = _address(self.transport)
        if address is not None and _TRANSPORTS.get(address) is self.transport:
            del _TRANSPORTS[address]
        super().connection_lost(exc)


@dataclass(frozen=True)
class ClientCertificate:
    """A client certificate the TLS handshake verified."""

    pem: str
    common_name: str | None  # the subject's commonName


def client_certificate(client: Any) -> ClientCertificate | None:
    """The verified client certificate of `client`'s connection (scope["client"]); None without TLS,
    without a certificate, or when unknown."""
    if not isinstance(client, (tuple, list)) or len(client) < 2:
        return None
    transport = _TRANSPORTS.get((str(client[0]), int(client[1])))
    ssl_object = transport.get_extra_info("ssl_object") if transport is not None else None
    if ssl_object is None:
        return None
    der = ssl_object.getpeercert(binary_form=True)
    verified = ssl_object.getpeercert()  # empty unless the handshake verified it
    if not der or not verified:
        return None
    names = [value for rdn in verified.get("subject", ()) for key, value in rdn if key == "commonName"]
    return ClientCertificate(ssl.DER_cert_to_PEM_cert(der), names[0] if names else None)


def unsent_bytes(client: Any) -> int:
    """Bytes written to the connection of `client` (scope["client"]) that it has not taken yet; 0 when
    unknown (another server, a Unix socket, a platform without SIOCOUTQ)."""
    if not isinstance(client, (tuple, list)) or len(client) < 2:
        return 0
    transport = _TRANSPORTS.get((str(client[0]), int(client[1])))
    if transport is None or transport.is_closing():
        return 0
    queued = transport.get_write_buffer_size() if isinstance(transport, asyncio.WriteTransport) else 0
    sock = transport.get_extra_info("socket")
    if sock is not None:
        try:
            queued += struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))[0]
        except OSError:
            pass
    return queued


async def wait_until_read(client: Any, limit: int = UNREAD_LIMIT_BYTES) -> None:
    """Return once the connection of `client` holds fewer than `limit` unread bytes (the caller bounds
    the wait)."""
    while unsent_bytes(client) >= limit:
        await asyncio.sleep(POLL_S)

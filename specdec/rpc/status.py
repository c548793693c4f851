"""Exceptions ⇄ gRPC status, the same for every service and client (one code per outcome).

Error mapping (server side), the same for every service:
  SessionGone                                        → FAILED_PRECONDITION (resend the context)
  AlreadyExists (a request_id with a stored record)  → ALREADY_EXISTS
  NotFound (no stored request of that id for the caller) → NOT_FOUND
  StillRunning (Resume of a request another run holds) → ABORTED
  Unauthenticated                                    → UNAUTHENTICATED
  PeerUnavailable (an orchestrator lost its verifier) → UNAVAILABLE
  Overloaded (an engine's KV budget or session cap, or the orchestrator's request slots, full)
                                                     → RESOURCE_EXHAUSTED "overloaded: …" (retry later)
  InvalidRequest / SamplingParamsError / VerificationError / other ValueError
                                                     → INVALID_ARGUMENT (message names the field)
  other EngineError                                  → INTERNAL with a short message
  anything else                                      → INTERNAL "internal error" (logged by the
                                                       server, never a stack trace to the client)
Clients map the codes back (error_from_status) so the orchestrator sees the same exceptions
on both transports. RESOURCE_EXHAUSTED has two causes: Overloaded (its details start with
OVERLOADED_PREFIX; back to Overloaded) and a message over the size limit (grpc's own status;
RemoteError with a hint to raise max_message_mb).

Light on purpose (grpc and specdec.errors only, no torch): the light client (specdec.client) maps its
statuses here too.
"""

from __future__ import annotations

import re

import grpc

from specdec.errors import (
    AlreadyExists,
    EngineError,
    InvalidRequest,
    NotFound,
    Overloaded,
    PeerUnavailable,
    SessionGone,
    StillRunning,
    Unauthenticated,
)

MAX_DETAIL_CHARS = 300
# Starts the details of the RESOURCE_EXHAUSTED status an Overloaded becomes: tells it apart from
# grpc's own RESOURCE_EXHAUSTED (message too large), which never starts so.
OVERLOADED_PREFIX = "overloaded: "


def short_details(text: str) -> str:
    """`text` on one line, cut to MAX_DETAIL_CHARS: what a status's details may hold."""
    text = " ".join(str(text).split())
    return text if len(text) <= MAX_DETAIL_CHARS else text[: MAX_DETAIL_CHARS - 1] + "…"


# ------------------------------------------------------------------------------ server side


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The gRPC status an exception becomes (see the module docstring). An error a client raised for
    a peer's status goes on with its `public` text: never the peer's address."""
    text = exc.public if isinstance(exc, EngineError) and exc.public is not None else str(exc)
    if isinstance(exc, SessionGone):
        return grpc.StatusCode.FAILED_PRECONDITION, short_details(text or "session gone; resend the context")
    if isinstance(exc, PeerUnavailable):
        return grpc.StatusCode.UNAVAILABLE, short_details(text)
    if isinstance(exc, AlreadyExists):
        return grpc.StatusCode.ALREADY_EXISTS, short_details(text)
    if isinstance(exc, NotFound):
        return grpc.StatusCode.NOT_FOUND, short_details(text)
    if isinstance(exc, StillRunning):
        return grpc.StatusCode.ABORTED, short_details(text)
    if isinstance(exc, Unauthenticated):
        return grpc.StatusCode.UNAUTHENTICATED, short_details(text or "unauthenticated")
    if isinstance(exc, Overloaded):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, short_details(OVERLOADED_PREFIX + (text or "retry later"))
    if isinstance(exc, ValueError):  # InvalidRequest, SamplingParamsError, VerificationError
        return grpc.StatusCode.INVALID_ARGUMENT, short_details(text or type(exc).__name__)
    if isinstance(exc, EngineError):
        return grpc.StatusCode.INTERNAL, short_details(f"{type(exc).__name__}: {text}")
    return grpc.StatusCode.INTERNAL, "internal error (details in the server log)"


# ------------------------------------------------------------------------------ client side


UPSTREAM = "upstream service"  # how a peer is named to clients when its caller gives no name
# Addresses in grpc's own status details ("ipv4:127.0.0.1:50051", "[::1]:50051", "host:50051").
_ADDRESSES = re.compile(
    r"(?:ipv4|ipv6|unix|unix-abstract|vsock|dns):[^\s,;]*[^\s,;:]"
    r"|\[[0-9A-Fa-f:.%]+\](?::\d+)?"
    r"|\b(?:\d{1,3}\.){3}\d{1,3}(?::\d+)?\b"
    r"|\b[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?:\d{2,5}\b"
)


def without_addresses(text: str, address: str = "") -> str:
    """`text` with `address` and anything that looks like a network address replaced by <address>."""
    if address:
        text = text.replace(address, "<address>")
    return _ADDRESSES.sub("<address>", text)


def _from_peer(exc: EngineError, address: str, public: str) -> EngineError:
    exc.address, exc.public = address, public
    return exc


class RemoteError(EngineError):
    """A status with no closer engine exception (INTERNAL, RESOURCE_EXHAUSTED, …); keeps the code."""

    def __init__(self, code: grpc.StatusCode, details: str, address: str, service: str | None = None) -> None:
        super().__init__(f"{address}: {code.name}: {details}")
        self.code = code
        self.details = details
        self.address = address
        self.public = f"{service or UPSTREAM}: {code.name}: {without_addresses(details, address)}"


def error_from_status(
    code: grpc.StatusCode, details: str | None, address: str, service: str | None = None
) -> EngineError:
    """The exception a client raises for a failed call (the inverse of status_for).

    Its str() names the peer's `address` (for logs and the CLI); its `public` text, which a server
    passing the error on sends to its own clients, names the peer as `service` (e.g. "verifier"),
    without the address.
    """
    details = details or ""
    # CANCELLED as a status (not our own cancellation, which raises CancelledError here) is the
    # peer's server stopping with the call in flight: as unavailable as a refused connection.
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
        public = f"{service or UPSTREAM} unavailable ({code.name})"
        if details:
            public += f": {without_addresses(details, address)}"
        return _from_peer(PeerUnavailable(f"{address} unavailable ({code.name}): {details}"), address, public)
    if code == grpc.StatusCode.FAILED_PRECONDITION:
        return SessionGone(details)
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return InvalidRequest(details)
    if code == grpc.StatusCode.ALREADY_EXISTS:
        return AlreadyExists(details)
    if code == grpc.StatusCode.NOT_FOUND:
        return NotFound(details)
    if code == grpc.StatusCode.ABORTED:
        return StillRunning(details)
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return Unauthenticated(details)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        if details.startswith(OVERLOADED_PREFIX):
            overloaded = details.removeprefix(OVERLOADED_PREFIX)
            return _from_peer(Overloaded(f"{address}: {overloaded}"), address,
                              f"{service or UPSTREAM}: {overloaded}")
        return RemoteError(code, f"{details} (raise max_message_mb on both sides if a message is too large)",
                           address, service)
    return RemoteError(code, details, address, service)

"""The errors of generation and of the engines, one class per outcome a caller handles differently.

Every transport maps them to one status each and back (specdec.rpc.status), so a caller catches the
same class in-process and over gRPC. Light on purpose (no torch): the light client (specdec.client)
raises them.
"""

from __future__ import annotations

__all__ = [
    "AlreadyExists", "ContextTooLong", "EngineError", "InvalidRequest", "NotFound", "Overloaded",
    "PeerUnavailable", "SessionGone", "StillRunning", "StoreUnavailable", "Unauthenticated",
]


class EngineError(Exception):
    """Base of the errors engines raise; adapters map each subclass to one gRPC status.

    A client raising one for a peer's status sets `address` (the peer's host:port, for logs) and
    `public` (the text without it): a server passing the error on sends `public`, never the address.
    """

    address: str | None = None
    public: str | None = None


class InvalidRequest(EngineError, ValueError):
    """Bad field (→ INVALID_ARGUMENT). The message names the field."""


class SessionGone(EngineError):
    """Session unknown/evicted or behind the caller (→ FAILED_PRECONDITION); resend context."""


class PeerUnavailable(EngineError):
    """A service cannot be reached (→ UNAVAILABLE); the message names the address, `public` only the
    service."""


class Overloaded(EngineError):
    """No room for the call within its wait: an engine's KV budget or session cap held only busy
    sessions, or the orchestrator ran its maximum of requests (→ RESOURCE_EXHAUSTED). Retrying later
    is safe: nothing was changed. The message says what was full and which limit to raise."""


class ContextTooLong(InvalidRequest):
    """Sequence would exceed the model's context window (→ INVALID_ARGUMENT)."""


class AlreadyExists(EngineError):
    """A request_id that already has a stored record (→ ALREADY_EXISTS): resume it, or pick another."""


class NotFound(EngineError):
    """No stored request of that id for this caller (→ NOT_FOUND). A record bound to another caller
    reads as not found, so its existence is not revealed."""


class Unauthenticated(EngineError):
    """Missing or wrong credentials (→ UNAUTHENTICATED). The message never contains the token."""


class StoreUnavailable(PeerUnavailable):
    """The configured request store (Redis) cannot be reached (→ UNAVAILABLE, naming the store)."""


class StillRunning(EngineError):
    """Resume of a request that a live orchestrator is still running (→ ABORTED): one run at a time
    writes a record. Retry once it stops, or once its lease runs out without progress."""

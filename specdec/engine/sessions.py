"""Per-session state of an engine: a bounded dict with LRU + TTL eviction and a lock per session.

Engine methods run in worker threads, so every call holds its session's lock while it reads or
changes the session's tokens and KV cache. A session that is in use is never evicted; an
evicted one is simply forgotten (the caller gets SessionGone next time and resends).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from specdec.engine.api import ContextTooLong, InvalidRequest, SessionGone

S = TypeVar("S")


@dataclass(frozen=True)
class SessionConfig:
    max_sessions: int = 16
    ttl_seconds: float = 600.0

    def __post_init__(self) -> None:
        if self.max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1, got {self.max_sessions}")
        if not self.ttl_seconds > 0:
            raise ValueError(f"ttl_seconds must be > 0, got {self.ttl_seconds}")


class _Entry(Generic[S]):
    __slots__ = ("state", "lock", "last_used", "busy", "alive")

    def __init__(self, state: S, now: float) -> None:
        self.state = state
        self.lock = threading.Lock()
        self.last_used = now
        self.busy = 0  # callers holding or waiting for the lock
        self.alive = True


class SessionStore(Generic[S]):
    """Sessions by id. `factory()` builds the engine-specific state of a new session."""

    def __init__(
        self,
        factory: Callable[[], S],
        config: SessionConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
        size_of: Callable[[S], int] | None = None,
    ) -> None:
        """size_of(state): KV-cache tokens a session holds (the memory budget counts them)."""
        self.factory = factory
        self.size_of = size_of or (lambda state: 0)
        self.config = config or SessionConfig()
        self.clock = clock
        self._entries: OrderedDict[str, _Entry[S]] = OrderedDict()
        self._lock = threading.Lock()
        self.evictions = 0  # sessions dropped by the store: LRU (to make room) + TTL
        self.expirations = 0  # the TTL part of `evictions` (ttl_seconds without use)
        self.created = 0
        self.released = 0

    @property
    def active_sessions(self) -> int:
        with self._lock:
            return len(self._entries)

    def __contains__(self, session_id: str) -> bool:
        with self._lock:
            return session_id in self._entries

    @contextmanager
    def use(self, session_id: str, base_len: int) -> Iterator[S]:
        """Hold the session for one call.

        base_len == 0 creates the session if needed (the caller then resets its committed
        tokens); base_len > 0 requires a live session, else SessionGone. The check that the
        session holds at least base_len tokens is the engine's (it knows the token list).
        """
        if not session_id:
            raise InvalidRequest("session_id must be a non-empty string")
        if base_len < 0:
            raise InvalidRequest(f"base_len must be >= 0, got {base_len}")
        entry = self._checkout(session_id, base_len)
        try:
            with entry.lock:
                if not entry.alive:  # released while we waited for the lock
                    raise SessionGone(
                        f"session {session_id!r} was released; resend the context with base_len=0"
                    )
                yield entry.state
        finally:
            with self._lock:
                entry.busy -= 1
                entry.last_used = self.clock()

    def _checkout(self, session_id: str, base_len: int) -> _Entry[S]:
        with self._lock:
            now = self.clock()
            self._expire(now)
            entry = self._entries.get(session_id)
            if entry is None:
                if base_len > 0:
                    raise SessionGone(
                        f"session {session_id!r} is unknown or was evicted; "
                        "resend the context with base_len=0"
                    )
                self._make_room()
                entry = _Entry(self.factory(), now)
                self._entries[session_id] = entry
                self.created += 1
            self._entries.move_to_end(session_id)
            entry.last_used = now
            entry.busy += 1
            return entry

    def _expire(self, now: float) -> None:
        ttl = self.config.ttl_seconds
        for session_id in [s for s, e in self._entries.items() if not e.busy and now - e.last_used > ttl]:
            self._drop(session_id)
            self.expirations += 1
            self.evictions += 1

    def _make_room(self) -> None:
        while len(self._entries) >= self.config.max_sessions:
            victim = next((s for s, e in self._entries.items() if not e.busy), None)
            if victim is None:  # every session is in use: go over the limit rather than fail
                return
            self._drop(victim)
            self.evictions += 1

    def _drop(self, session_id: str) -> None:
        entry = self._entries.pop(session_id)
        entry.alive = False

    def release(self, session_id: str) -> bool:
        """Forget a session (its cache is freed once no call holds it). True if it existed."""
        with self._lock:
            if session_id not in self._entries:
                return False
            self._drop(session_id)
            self.released += 1
            return True

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                "active_sessions": len(self._entries),
                "evictions": self.evictions,
                "expirations": self.expirations,
                "created": self.created,
                "released": self.released,
            }


# ------------------------------------------------------------------------------------------------
# the session protocol's checks, shared by both engines


def advance(committed: list[int], session_id: str, base_len: int, append: list[int]) -> list[int]:
    """committed[:base_len] + append, or SessionGone when the session holds fewer than base_len."""
    if base_len > len(committed):
        raise SessionGone(
            f"session {session_id!r} holds {len(committed)} committed tokens but the call assumes "
            f"{base_len}; resend the context with base_len=0"
        )
    result = committed[:base_len] + [int(t) for t in append]
    if not result:
        raise InvalidRequest("append must not be empty when base_len is 0 (the sequence needs >= 1 token)")
    return result


def check_tokens(field_name: str, tokens: list[int], vocab_size: int) -> None:
    bad = [t for t in tokens if not 0 <= int(t) < vocab_size]
    if bad:
        raise InvalidRequest(f"{field_name} holds token ids outside [0, {vocab_size}): {bad[:8]}")


def check_context(needed: int, max_context: int) -> None:
    """`needed` = committed length + tree depth: the positions this call would occupy."""
    if max_context > 0 and needed > max_context:
        raise ContextTooLong(
            f"sequence would reach {needed} positions, beyond the model's context window of {max_context}"
        )

"""Per-session state of an engine: KV caches bounded by memory, LRU + TTL eviction, admission
control, and a lock per session.

Engine methods run in worker threads, so every call holds its session's lock while it reads or
changes the session's tokens and KV cache. Memory is the budget: SessionConfig.max_kv_tokens
caps the KV-cache tokens all sessions hold together (max_sessions is a second, looser cap).
When a new session needs room, idle sessions go, least recently used first; a session in use
is never evicted. When every session is in use and the budget is full, the call that needs a
new session waits (up to admission_timeout_s) for one to become idle, then fails with
Overloaded (gRPC RESOURCE_EXHAUSTED) rather than take memory the engine was not given.
Sessions grow during calls, so the budget is enforced again as each call ends. A background
thread frees sessions idle for longer than ttl_seconds (a caller that vanished never releases
its session). An evicted session is simply forgotten: its caller gets SessionGone next time
and resends the context.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from specdec.errors import ContextTooLong, InvalidRequest, Overloaded, SessionGone

log = logging.getLogger(__name__)

S = TypeVar("S")

# The background sweep runs every ttl/4, at least this often (a long TTL still frees memory soon
# after it passes).
MAX_SWEEP_INTERVAL_S = 30.0


@dataclass(frozen=True)
class SessionConfig:
    # A cap on the number of sessions, on top of the KV budget (which usually binds first).
    max_sessions: int = 1024
    # Seconds without a call after which a session is freed (in the background).
    ttl_seconds: float = 600.0
    # KV-cache tokens (entries of all layers for one position) all sessions may hold together;
    # None: no limit but max_sessions. The CLI derives it from --kv-cache-mb (kv_bytes_per_token).
    max_kv_tokens: int | None = None
    # How long a call that needs a new session waits for room while every session is in use.
    admission_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if self.max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1, got {self.max_sessions}")
        if not self.ttl_seconds > 0:
            raise ValueError(f"ttl_seconds must be > 0, got {self.ttl_seconds}")
        if self.max_kv_tokens is not None and self.max_kv_tokens < 1:
            raise ValueError(f"max_kv_tokens must be >= 1 or None (no limit), got {self.max_kv_tokens}")
        if not self.admission_timeout_s >= 0:
            raise ValueError(f"admission_timeout_s must be >= 0, got {self.admission_timeout_s}")


class _Entry(Generic[S]):
    __slots__ = ("state", "lock", "last_used", "busy", "alive", "size", "ending")

    def __init__(self, state: S, now: float, size: int) -> None:
        self.state = state
        self.lock = threading.Lock()
        self.last_used = now
        self.busy = 0  # callers holding or waiting for the lock
        self.alive = True
        self.size = size  # KV tokens, as measured at the end of the session's last call
        self.ending: Callable[[S], None] | None = None  # runs once a released session's last call leaves


class SessionStore(Generic[S]):
    """Sessions by id. `factory()` builds the engine-specific state of a new session."""

    def __init__(
        self,
        factory: Callable[[], S],
        config: SessionConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
        size_of: Callable[[S], int] | None = None,
    ) -> None:
        """size_of(state): KV-cache tokens a session holds (the memory budget counts them).

        `clock` dates the sessions' use (TTL); admission waits always run on real time.
        """
        self.factory = factory
        self.size_of = size_of or (lambda state: 0)
        self.config = config or SessionConfig()
        self.clock = clock
        self._entries: OrderedDict[str, _Entry[S]] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()
        self._room = threading.Condition(self._lock)  # notified whenever a session may have left or idled
        self._queue: deque[object] = deque()  # calls waiting for room for a new session, in arrival order
        self._kv_tokens = 0  # sum of the entries' sizes
        self._sweeper: threading.Thread | None = None
        self._stop_sweeper: weakref.finalize | None = None
        self._closed = False
        self.evictions = 0  # sessions dropped by the store: LRU (to make room, budget) + TTL
        self.expirations = 0  # the TTL part of `evictions` (ttl_seconds without use)
        self.budget_evictions = 0  # the part of `evictions` made to keep the KV tokens within the budget
        self.rejections = 0  # calls refused with Overloaded (no room within admission_timeout_s)
        self.created = 0
        self.released = 0

    @property
    def active_sessions(self) -> int:
        with self._lock:
            return len(self._entries)

    @property
    def kv_tokens(self) -> int:
        """KV tokens the sessions hold (each as of the end of its last call)."""
        with self._lock:
            return self._kv_tokens

    def __contains__(self, session_id: str) -> bool:
        with self._lock:
            return session_id in self._entries

    @contextmanager
    def use(self, session_id: str, base_len: int) -> Iterator[S]:
        """Hold the session for one call.

        base_len == 0 creates the session if needed (the caller then resets its committed
        tokens); base_len > 0 requires a live session, else SessionGone. The check that the
        session holds at least base_len tokens is the engine's (it knows the token list).
        Creating a session may wait for room and raise Overloaded (see the module docstring).
        """
        if not session_id:
            raise InvalidRequest("session_id must be a non-empty string")
        if base_len < 0:
            raise InvalidRequest(f"base_len must be >= 0, got {base_len}")
        entry = self._checkout(session_id, base_len)
        size: int | None = None
        try:
            with entry.lock:
                if not entry.alive:  # released while we waited for the lock
                    raise SessionGone(
                        f"session {session_id!r} was released; resend the context with base_len=0"
                    )
                try:
                    yield entry.state
                finally:
                    size = self._measure(entry.state)  # under the session's lock: no call changes it
        finally:
            self._checkin(session_id, entry, size)

    # ---------------------------------------------------------------------------- check out / in

    def _checkout(self, session_id: str, base_len: int) -> _Entry[S]:
        with self._lock:
            self._start_sweeper()
            self._expire(self.clock())
            entry = self._entries.get(session_id)
            if entry is None:
                if base_len > 0:
                    raise SessionGone(
                        f"session {session_id!r} is unknown or was evicted; "
                        "resend the context with base_len=0"
                    )
                entry = self._admit(session_id)
            self._entries.move_to_end(session_id)
            entry.last_used = self.clock()
            entry.busy += 1
            self._shrink(keep=entry)
            return entry

    def _checkin(self, session_id: str, entry: _Entry[S], size: int | None) -> None:
        with self._lock:
            entry.busy -= 1
            entry.last_used = self.clock()
            self._end(session_id, entry)
            if entry.alive:
                self._entries.move_to_end(session_id)
                if size is not None:
                    self._kv_tokens += size - entry.size
                    entry.size = size
                # The call may have grown the session past the budget: other idle sessions make way
                # (not this one, whose caller is about to come back).
                self._shrink(keep=entry)
            self._room.notify_all()

    def _measure(self, state: S) -> int | None:
        try:
            return max(0, int(self.size_of(state)))
        except Exception:  # accounting must never fail a call that did its work
            log.exception("could not measure a session's KV cache")
            return None

    # ---------------------------------------------------------------------------- room and admission

    def _admit(self, session_id: str) -> _Entry[S]:
        """A new session under `session_id`, once there is room; the lock is held (waits release it).

        Calls wait in arrival order; the first one makes room by evicting idle sessions. When only
        busy sessions are left it waits for one of them to finish or go, for at most
        admission_timeout_s of real time, then raises Overloaded.
        """
        ticket = object()
        self._queue.append(ticket)
        deadline = time.monotonic() + self.config.admission_timeout_s
        try:
            while True:
                entry = self._entries.get(session_id)
                if entry is not None:  # a concurrent call created it while this one waited
                    return entry
                if self._queue[0] is ticket and self._make_room():
                    state = self.factory()
                    entry = _Entry(state, self.clock(), self._measure(state) or 0)
                    self._entries[session_id] = entry
                    self._kv_tokens += entry.size
                    self.created += 1
                    return entry
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    self.rejections += 1
                    raise Overloaded(self._full_message(ahead=self._queue.index(ticket)))
                self._room.wait(remaining)
        finally:
            self._queue.remove(ticket)
            if self._queue:
                self._room.notify_all()  # the next in line may go ahead now

    def _over_budget(self, strictly: bool) -> bool:
        budget = self.config.max_kv_tokens
        if budget is None:
            return False
        return self._kv_tokens > budget if strictly else self._kv_tokens >= budget

    def _full(self) -> bool:
        """No room for one more session: the session cap is reached or the KV budget is used up."""
        return len(self._entries) >= self.config.max_sessions or self._over_budget(strictly=False)

    def _make_room(self) -> bool:
        """Evict idle sessions (least recently used first) until a new one fits; False when only busy
        sessions are left."""
        while self._full():
            if not self._evict_lru(keep=None, by_budget=self._over_budget(strictly=False)):
                return False
        return True

    def _shrink(self, keep: _Entry[S]) -> None:
        """Evict idle sessions other than `keep`, least recently used first, while the KV tokens
        exceed the budget (busy sessions grow during calls; they cannot be stopped)."""
        while self._over_budget(strictly=True) and self._evict_lru(keep=keep, by_budget=True):
            pass

    def _evict_lru(self, keep: _Entry[S] | None, by_budget: bool) -> bool:
        victim = next((s for s, e in self._entries.items() if not e.busy and e is not keep), None)
        if victim is None:
            return False
        self._drop(victim)
        self.evictions += 1
        if by_budget:
            self.budget_evictions += 1
        return True

    def _full_message(self, ahead: int) -> str:
        """What was full when a call gave up waiting, and what to do about it."""
        waited = f"waited {self.config.admission_timeout_s:g} s"
        busy = sum(1 for e in self._entries.values() if e.busy)
        budget = self.config.max_kv_tokens
        if budget is not None and self._kv_tokens >= budget:
            return (f"KV budget full: {self._kv_tokens} of {budget} tokens held by {busy} busy sessions "
                    f"({waited} for one to finish); retry later or raise --kv-cache-mb")
        if len(self._entries) >= self.config.max_sessions:
            return (f"session limit full: {len(self._entries)} of {self.config.max_sessions} sessions, "
                    f"{busy} of them busy ({waited} for one to finish); retry later or raise --max-sessions")
        return (f"engine busy: {ahead} earlier calls were still waiting for room for a new session "
                f"({waited}); retry later or raise --kv-cache-mb")

    # ---------------------------------------------------------------------------- expiry, release

    def _expire(self, now: float) -> int:
        ttl = self.config.ttl_seconds
        expired = [s for s, e in self._entries.items() if not e.busy and now - e.last_used > ttl]
        for session_id in expired:
            self._drop(session_id)
            self.expirations += 1
            self.evictions += 1
        if expired:
            self._room.notify_all()
        return len(expired)

    def _end(self, session_id: str, entry: _Entry[S]) -> None:
        """Run a released session's `ending` once it is idle (the store's lock is held)."""
        ending = entry.ending
        if ending is None or entry.alive or entry.busy:
            return
        entry.ending = None
        try:
            ending(entry.state)
        except Exception:
            log.exception("ending session %s failed", session_id)

    def _drop(self, session_id: str) -> None:
        entry = self._entries.pop(session_id)
        entry.alive = False
        self._kv_tokens -= entry.size

    def release(self, session_id: str, ending: Callable[[S], None] | None = None) -> bool:
        """Forget a session (its cache is freed once no call holds it). True if it existed.
        `ending` sees the session's state once no call holds it (now, or when the last call in
        flight leaves): what it keeps for later sessions. A failure there is logged, and the
        session goes all the same."""
        with self._lock:
            entry = self._entries.get(session_id)
            if entry is None:
                return False
            entry.ending = ending
            self._drop(session_id)
            self._end(session_id, entry)
            self.released += 1
            self._room.notify_all()
            return True

    def sweep(self) -> int:
        """Free the sessions idle for longer than the TTL now; returns how many. The background
        thread calls this; calls do it too on their way in."""
        with self._lock:
            return self._expire(self.clock())

    def _start_sweeper(self) -> None:
        """Start the background sweep on first use (the lock is held). The thread holds only a weak
        reference to the store: it ends when the store is collected or closed."""
        if self._sweeper is not None or self._closed:
            return
        stop = threading.Event()
        interval = min(self.config.ttl_seconds / 4, MAX_SWEEP_INTERVAL_S)
        thread = threading.Thread(target=_sweep_until_stopped, args=(weakref.ref(self), stop, interval),
                                  name="session-sweeper", daemon=True)
        self._stop_sweeper = weakref.finalize(self, stop.set)  # also runs at interpreter exit
        self._sweeper = thread
        thread.start()

    @property
    def sweeping(self) -> bool:
        """Whether the background sweep thread is running."""
        thread = self._sweeper
        return thread is not None and thread.is_alive()

    def close(self) -> None:
        """Stop the background sweep and forget every session (their caches are freed once no call
        holds them). Idempotent. Calls made afterwards still work, but sessions then expire only
        when a call comes in."""
        with self._lock:
            self._closed = True
            for session_id in list(self._entries):
                self._drop(session_id)
            self._room.notify_all()
            thread, stop = self._sweeper, self._stop_sweeper
        if stop is not None:
            stop()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5.0)

    def stats(self) -> dict[str, Any]:
        """Counters and gauges for /metrics (orchestrator.metrics reads them at scrape time)."""
        with self._lock:
            return {
                "active_sessions": len(self._entries),
                "evictions": self.evictions,
                "expirations": self.expirations,
                "budget_evictions": self.budget_evictions,
                "rejections": self.rejections,
                "created": self.created,
                "released": self.released,
                "waiting": len(self._queue),
                "kv_tokens": self._kv_tokens,
                "kv_budget_tokens": self.config.max_kv_tokens or 0,  # 0: no budget
            }


def _sweep_until_stopped(ref: weakref.ref[SessionStore[Any]], stop: threading.Event, interval: float) -> None:
    """The sweeper thread: every `interval` seconds, free the store's expired sessions, until the
    store is closed or collected. No strong reference to the store survives a sleep."""
    while not stop.wait(interval):
        store = ref()
        if store is None:
            return
        try:
            store.sweep()
        except Exception:  # keep sweeping: one bad pass must not leave memory held for good
            log.exception("session sweep failed")
        store = None


def kv_bytes_per_token(model: Any) -> int:
    """Bytes of KV cache one token takes in `model` (a transformers causal LM): keys and values of
    every layer, num_key_value_heads x head_dim each, in the model's compute dtype. Turns the
    CLI's --kv-cache-mb into SessionConfig.max_kv_tokens."""
    config = model.config
    if hasattr(config, "get_text_config"):  # multimodal configs nest the language model's
        config = config.get_text_config()
    layers = int(config.num_hidden_layers)
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    return layers * 2 * kv_heads * head_dim * _kv_element_size(model)


def _kv_element_size(model: Any) -> int:
    """Bytes per cached element: the dtype of the model's floating-point parameters, except for an
    int8 model, which caches what its invariant attention reads (specdec.runtime.int8)."""
    from specdec.runtime.int8 import kv_element_size  # torch: only where a model is at hand

    cached = kv_element_size(model)
    if cached is not None:
        return cached
    for param in model.parameters():
        if param.is_floating_point():
            return int(param.element_size())
    return 4


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


# The longest prefix-cache partition an engine takes (the orchestrator's is the caller's identity digest
# and a salt of at most orchestrator.request_checks.MAX_CACHE_SALT_CHARS).
MAX_PARTITION_CHARS = 1024


def check_partition(partition: str) -> None:
    if not isinstance(partition, str) or len(partition) > MAX_PARTITION_CHARS:
        raise InvalidRequest(f"cache_partition must be a string of at most {MAX_PARTITION_CHARS} characters")


def check_context(needed: int, max_context: int) -> None:
    """`needed` = committed length + tree depth: the positions this call would occupy."""
    if max_context > 0 and needed > max_context:
        raise ContextTooLong(
            f"sequence would reach {needed} positions, beyond the model's context window of {max_context}"
        )

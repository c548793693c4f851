"""The session store: protocol checks, LRU and TTL eviction, locking."""

from __future__ import annotations

import threading
import time

import pytest

from specdec.engine.api import ContextTooLong, InvalidRequest, SessionGone
from specdec.engine.sessions import SessionConfig, SessionStore, advance, check_context, check_tokens


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_store(max_sessions: int = 3, ttl: float = 10.0) -> tuple[SessionStore[dict], Clock]:
    clock = Clock()
    return SessionStore(dict, SessionConfig(max_sessions=max_sessions, ttl_seconds=ttl), clock), clock


def test_base_len_zero_creates_and_positive_needs_a_session():
    store, _ = make_store()
    with pytest.raises(SessionGone, match="resend"):
        with store.use("a", 3):
            pass
    with store.use("a", 0) as state:
        state["x"] = 1
    with store.use("a", 5) as state:  # the token-count check is the engine's (advance)
        assert state == {"x": 1}
    assert store.active_sessions == 1 and store.created == 1


def test_lru_eviction_drops_the_least_recently_used():
    store, clock = make_store(max_sessions=2)
    for name in ("a", "b"):
        with store.use(name, 0):
            clock.now += 1
    with store.use("a", 1):  # touch a: b is now least recently used
        pass
    with store.use("c", 0):
        pass
    assert "b" not in store and "a" in store and "c" in store
    assert store.evictions == 1 and store.expirations == 0 and store.active_sessions == 2
    with pytest.raises(SessionGone):
        with store.use("b", 4):
            pass


def test_ttl_expiry():
    store, clock = make_store(ttl=10.0)
    with store.use("a", 0):
        pass
    clock.now += 5
    with store.use("b", 0):
        pass
    clock.now += 6  # a idle 11 s, b idle 6 s
    with store.use("b", 1):
        pass
    assert "a" not in store and "b" in store
    assert store.expirations == 1 and store.evictions == 1


def test_sessions_in_use_are_not_evicted():
    store, clock = make_store(max_sessions=1, ttl=1.0)
    with store.use("a", 0):
        clock.now += 100  # expired and over capacity, but busy
        with store.use("b", 0):
            assert "a" in store
    assert store.active_sessions == 2
    with store.use("c", 0):  # now both idle: room is made
        pass
    assert "c" in store and store.active_sessions == 1 and store.evictions == 2


def test_release_and_stats():
    store, _ = make_store()
    with store.use("a", 0):
        pass
    assert store.release("a") is True
    assert store.release("a") is False
    assert store.stats() == {
        "active_sessions": 0,
        "evictions": 0,
        "expirations": 0,
        "created": 1,
        "released": 1,
    }


def test_release_while_waiting_for_the_lock_raises_session_gone():
    store, _ = make_store()
    errors: list[BaseException] = []
    entered = threading.Event()

    def waiter() -> None:
        entered.wait(5)
        try:
            with store.use("a", 1):
                pass
        except SessionGone as exc:
            errors.append(exc)

    with store.use("a", 0):
        thread = threading.Thread(target=waiter)
        thread.start()
        entered.set()
        time.sleep(0.2)  # let the waiter block on the session lock
        store.release("a")
    thread.join(5)
    assert len(errors) == 1


def test_calls_on_one_session_are_serialised():
    store, _ = make_store()
    with store.use("a", 0) as state:
        state["n"] = 0
    inside = []

    def work() -> None:
        for _ in range(50):
            with store.use("a", 1) as s:
                inside.append(1)
                assert len(inside) == 1
                s["n"] += 1
                inside.pop()

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    with store.use("a", 1) as state:
        assert state["n"] == 200


def test_bad_arguments():
    store, _ = make_store()
    with pytest.raises(InvalidRequest):
        with store.use("", 0):
            pass
    with pytest.raises(InvalidRequest):
        with store.use("a", -1):
            pass
    with pytest.raises(ValueError):
        SessionConfig(max_sessions=0)
    with pytest.raises(ValueError):
        SessionConfig(ttl_seconds=0)


def test_protocol_helpers():
    assert advance([1, 2, 3], "s", 2, [7, 8]) == [1, 2, 7, 8]
    assert advance([1, 2, 3], "s", 0, [4]) == [4]
    with pytest.raises(SessionGone, match="holds 3 committed tokens"):
        advance([1, 2, 3], "s", 4, [])
    with pytest.raises(InvalidRequest):
        advance([], "s", 0, [])
    check_tokens("append", [0, 7], 8)
    with pytest.raises(InvalidRequest, match="append"):
        check_tokens("append", [8], 8)
    with pytest.raises(InvalidRequest):
        check_tokens("append", [-1], 8)
    check_context(64, 64)
    with pytest.raises(ContextTooLong):
        check_context(65, 64)

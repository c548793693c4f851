"""The session store: protocol checks, LRU and TTL eviction, the KV budget, admission control, the
background sweep, locking."""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Callable

import pytest

from specdec.engine.sessions import (
    SessionConfig,
    SessionStore,
    advance,
    check_context,
    check_tokens,
    kv_bytes_per_token,
)
from specdec.errors import ContextTooLong, InvalidRequest, Overloaded, SessionGone

WAIT_S = 20.0  # bound of every wait for another thread (never reached unless something is broken)


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
    clock = Clock()
    store = SessionStore(dict, SessionConfig(max_sessions=1, ttl_seconds=1.0, admission_timeout_s=0), clock)
    with store.use("a", 0):
        clock.now += 100  # expired and at capacity, but busy
        with pytest.raises(Overloaded, match=r"session limit full: 1 of 1 sessions, 1 of them busy.*"
                                             r"raise --max-sessions"):
            with store.use("b", 0):
                pass
        assert "a" in store and "b" not in store
    assert store.stats()["rejections"] == 1
    with store.use("c", 0):  # now a is idle (and expired): room is made
        pass
    assert "c" in store and store.active_sessions == 1 and store.evictions == 1


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
        "budget_evictions": 0,
        "rejections": 0,
        "created": 1,
        "released": 1,
        "waiting": 0,
        "kv_tokens": 0,
        "kv_budget_tokens": 0,
    }


def test_release_ends_a_session_once_no_call_holds_it_and_goes_on_when_ending_fails():
    """The engines keep a released session's last partial block (EngineCore.release): from the
    session as no call holds it (at once, or as the last call in flight leaves), and a failure there
    loses the block, not the release."""
    store, _ = make_store()
    ended: list[dict] = []
    with store.use("idle", 0) as state:
        state["n"] = 1
    assert store.release("idle", ended.append) and ended == [{"n": 1}]
    with store.use("busy", 0) as state:
        state["n"] = 2
        assert store.release("busy", ended.append) and len(ended) == 1  # a call holds it: not yet
        state["n"] = 3
    assert ended == [{"n": 1}, {"n": 3}]  # as the call left, once
    with store.use("broken", 0):
        pass

    def broken(state: dict) -> None:
        raise RuntimeError("boom")

    assert store.release("broken", broken) and store.stats()["released"] == 3


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
    with pytest.raises(ValueError, match="max_kv_tokens"):
        SessionConfig(max_kv_tokens=0)
    with pytest.raises(ValueError, match="admission_timeout_s"):
        SessionConfig(admission_timeout_s=-1)


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


# ------------------------------------------------------------------------------------------------
# the KV budget and admission control (states are dicts; "n" is the KV tokens a session holds)


def budget_store(max_kv_tokens: int | None, max_sessions: int = 100, timeout: float = 0.0,
                 ttl: float = 600.0) -> tuple[SessionStore[dict], Clock]:
    clock = Clock()
    config = SessionConfig(max_sessions=max_sessions, ttl_seconds=ttl, max_kv_tokens=max_kv_tokens,
                           admission_timeout_s=timeout)
    return SessionStore(dict, config, clock, size_of=lambda state: state.get("n", 0)), clock


def grow(store: SessionStore[dict], session_id: str, n: int) -> None:
    """One call that leaves the session holding n KV tokens (creating it if needed)."""
    with store.use(session_id, 0) as state:
        state["n"] = n


def wait_until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def test_the_token_budget_evicts_idle_sessions_least_recently_used_first():
    store, _ = budget_store(max_kv_tokens=10)
    grow(store, "a", 4)
    grow(store, "b", 4)
    assert store.kv_tokens == 8 and store.stats()["kv_budget_tokens"] == 10
    grow(store, "c", 4)  # 12 > 10 when c's call ends: a, the least recently used, goes (never c itself)
    assert "a" not in store and {"b", "c"} <= {s for s in ("a", "b", "c") if s in store}
    assert store.kv_tokens == 8
    with store.use("b", 1):  # b is now more recent than c
        pass
    grow(store, "d", 3)  # 11 > 10: c goes
    assert "c" not in store and "b" in store and "d" in store
    stats = store.stats()
    assert stats["kv_tokens"] == 7 and stats["budget_evictions"] == 2 and stats["evictions"] == 2
    assert stats["expirations"] == 0 and stats["rejections"] == 0


def test_a_new_session_needs_room_below_the_budget():
    store, _ = budget_store(max_kv_tokens=8)
    grow(store, "a", 4)
    grow(store, "b", 4)  # exactly at the budget: nothing to evict yet
    assert store.active_sessions == 2 and store.stats()["budget_evictions"] == 0
    grow(store, "c", 1)  # full (8 of 8): a makes way before c is created
    assert "a" not in store and store.kv_tokens == 5 and store.stats()["budget_evictions"] == 1


def test_busy_sessions_are_never_evicted_and_a_full_budget_rejects_new_ones():
    store, _ = budget_store(max_kv_tokens=10)
    grow(store, "a", 12)  # one session over the budget alone: nothing else to evict, a stays
    assert "a" in store and store.kv_tokens == 12
    with store.use("a", 1) as state:
        with pytest.raises(Overloaded) as caught:
            grow(store, "b", 1)
        state["n"] = 13
    message = str(caught.value)
    assert message.startswith("KV budget full: 12 of 10 tokens held by 1 busy sessions")
    assert "retry later or raise --kv-cache-mb" in message
    assert "a" in store and "b" not in store and store.kv_tokens == 13
    assert store.stats()["rejections"] == 1
    grow(store, "b", 2)  # a is idle now: it makes way
    assert "a" not in store and store.kv_tokens == 2


def test_a_call_that_grows_its_session_evicts_others_when_it_ends():
    store, _ = budget_store(max_kv_tokens=10)
    grow(store, "a", 3)
    grow(store, "b", 3)
    started, finish = threading.Event(), threading.Event()

    def long_call() -> None:
        with store.use("b", 1) as state:
            started.set()
            finish.wait(WAIT_S)
            state["n"] = 9

    thread = threading.Thread(target=long_call)
    thread.start()
    started.wait(WAIT_S)
    grow(store, "c", 3)  # 9 of 10: no eviction yet
    assert {"a", "b", "c"} == {s for s in ("a", "b", "c") if s in store}
    finish.set()
    thread.join(WAIT_S)
    # b grew to 9 (15 in all): the least recently used idle sessions make way, b stays
    assert "b" in store and "a" not in store and "c" not in store
    assert store.kv_tokens == 9 and store.stats()["budget_evictions"] == 2


def test_released_and_expired_sessions_leave_the_budget():
    store, clock = budget_store(max_kv_tokens=100, ttl=10.0)
    grow(store, "a", 5)
    grow(store, "b", 7)
    assert store.release("a") and store.kv_tokens == 7
    clock.now += 11
    assert store.sweep() == 1 and store.kv_tokens == 0 and store.active_sessions == 0


def test_overloaded_after_the_admission_timeout():
    store, _ = budget_store(max_kv_tokens=None, max_sessions=1, timeout=0.2)
    with store.use("a", 0):
        started = time.monotonic()
        with pytest.raises(Overloaded, match="session limit full: 1 of 1 sessions.*waited 0.2 s"):
            grow(store, "b", 1)
        assert time.monotonic() - started >= 0.19  # it did wait (a lower bound only: never flaky)
    stats = store.stats()
    assert stats["rejections"] == 1 and stats["waiting"] == 0 and stats["created"] == 1


def _call_in_thread(store: SessionStore[dict], session_id: str, n: int, hold: threading.Event | None,
                    done: list[str]) -> threading.Thread:
    """A thread that makes one call on session_id (creating it), holding it until `hold` is set."""

    def call() -> None:
        try:
            with store.use(session_id, 0) as state:
                state["n"] = n
                done.append(session_id)
                if hold is not None:
                    hold.wait(WAIT_S)
        except Overloaded as exc:
            done.append(f"overloaded: {exc}")

    thread = threading.Thread(target=call)
    thread.start()
    return thread


def test_a_waiting_call_is_admitted_when_a_busy_session_finishes():
    store, _ = budget_store(max_kv_tokens=10, timeout=WAIT_S)
    grow(store, "a", 10)  # the budget is full (sizes count as of each session's last call)
    done: list[str] = []
    hold_a = threading.Event()
    holder = _call_in_thread(store, "a", 10, hold_a, done)
    wait_until(lambda: done == ["a"], "a's call to start")
    waiter = _call_in_thread(store, "b", 1, None, done)
    wait_until(lambda: store.stats()["waiting"] == 1, "b's call to wait for room")
    assert "b" not in store
    hold_a.set()  # a's call ends (a holds 10 of 10): b is admitted, a evicted for it
    holder.join(WAIT_S)
    waiter.join(WAIT_S)
    assert not holder.is_alive() and not waiter.is_alive()
    assert done == ["a", "b"]
    assert "a" not in store and "b" in store
    stats = store.stats()
    assert stats["waiting"] == 0 and stats["rejections"] == 0 and stats["budget_evictions"] == 1


def test_waiting_calls_are_admitted_in_arrival_order():
    store, _ = budget_store(max_kv_tokens=None, max_sessions=1, timeout=WAIT_S)
    done: list[str] = []
    holds = {name: threading.Event() for name in "abc"}
    threads = [_call_in_thread(store, "a", 1, holds["a"], done)]
    wait_until(lambda: done == ["a"], "a's call to start")
    for count, name in enumerate("bc", start=1):
        threads.append(_call_in_thread(store, name, 1, holds[name], done))
        wait_until(lambda count=count: store.stats()["waiting"] == count, f"{name}'s call to wait")
    holds["a"].set()
    wait_until(lambda: len(done) == 2, "the first waiter")
    assert done == ["a", "b"] and store.stats()["waiting"] == 1  # c still waits: b is busy
    holds["b"].set()
    holds["c"].set()
    for thread in threads:
        thread.join(WAIT_S)
    assert done == ["a", "b", "c"] and store.stats()["evictions"] == 2


# ------------------------------------------------------------------------------------------------
# the background sweep


def _sweepers() -> int:
    return sum(1 for t in threading.enumerate() if t.name == "session-sweeper" and t.is_alive())


def test_the_background_sweep_frees_an_idle_session_without_any_call():
    store = SessionStore(dict, SessionConfig(ttl_seconds=0.2), size_of=lambda state: state.get("n", 0))
    assert not store.sweeping  # started on first use, not before
    grow(store, "a", 5)
    assert store.sweeping
    wait_until(lambda: "a" not in store, "the sweep to free the idle session")  # real clock, no call
    stats = store.stats()
    assert stats["expirations"] == 1 and stats["kv_tokens"] == 0 and stats["active_sessions"] == 0
    store.close()
    assert not store.sweeping


def test_the_sweep_leaves_busy_sessions_alone():
    store = SessionStore(dict, SessionConfig(ttl_seconds=0.05))
    with store.use("a", 0):
        time.sleep(0.3)  # several sweeps pass meanwhile
        assert "a" in store
    store.close()


def test_close_stops_the_sweep_and_forgets_the_sessions():
    store, _ = budget_store(max_kv_tokens=100)
    grow(store, "a", 3)
    thread = store._sweeper
    assert thread is not None and thread.is_alive()
    store.close()
    assert not thread.is_alive() and store.active_sessions == 0 and store.kv_tokens == 0
    store.close()  # idempotent
    grow(store, "b", 1)  # still usable, without a background thread
    assert "b" in store and not store.sweeping


def test_collected_stores_leave_no_sweeper_behind():
    gc.collect()
    before = _sweepers()
    for i in range(200):
        store = SessionStore(dict, SessionConfig(ttl_seconds=600.0))
        with store.use(f"s{i}", 0):
            pass
    thread = store._sweeper
    del store
    gc.collect()
    assert thread is not None
    thread.join(WAIT_S)
    assert not thread.is_alive()
    wait_until(lambda: _sweepers() <= before, "the sweepers of collected stores to end")


# ------------------------------------------------------------------------------------------------
# bytes per KV token, and the budget in a real engine


def test_kv_bytes_per_token_of_a_tiny_model(draft_model, monkeypatch):
    import torch

    from specdec.runtime.fixed_attention import ATTENTION_ENV, FLOAT64
    from specdec.runtime.loading import quantize_int8
    from specdec.runtime.tiny import build_tiny_model

    config = draft_model.model.config  # 2 layers, 1 KV head of 16 / 2 = 8 dims, float32
    assert (config.num_hidden_layers, config.num_key_value_heads) == (2, 1)
    assert kv_bytes_per_token(draft_model.model) == 2 * 2 * 1 * 8 * 4
    half = build_tiny_model(hidden_size=16, num_layers=3).to(torch.bfloat16)
    assert kv_bytes_per_token(half) == 3 * 2 * 1 * 8 * 2
    # int8 caches what its invariant attention reads: float32 for the fixed-order kernel
    assert kv_bytes_per_token(quantize_int8(build_tiny_model(hidden_size=16))) == 2 * 2 * 1 * 8 * 4
    monkeypatch.setenv(ATTENTION_ENV, FLOAT64)  # float64 for the float64 attention
    assert kv_bytes_per_token(quantize_int8(build_tiny_model(hidden_size=16))) == 2 * 2 * 1 * 8 * 8
    explicit = build_tiny_model(hidden_size=16)
    explicit.config.head_dim = 4  # a config that states its head size wins over hidden / heads
    assert kv_bytes_per_token(explicit) == 2 * 2 * 1 * 4 * 4


def test_kv_bytes_per_token_matches_the_engine_cache(draft_model):
    from specdec.engine.api import DraftRequest
    from specdec.engine.drafter import DrafterEngine
    from specdec.sampling import SamplingParams

    engine = DrafterEngine(draft_model)
    engine.draft(DraftRequest("s", 0, [1, 2, 3, 4, 5], [-1, 0], SamplingParams(), seed=1))
    with engine.sessions.use("s", 1) as session:
        states = [s for s in session.kv.layer_states() if s is not None]
        held = session.kv.physical_len()
        nbytes = sum(k.nelement() * k.element_size() + v.nelement() * v.element_size() for k, v in states)
    assert held > 0 and nbytes == held * kv_bytes_per_token(draft_model.model)
    assert engine.stats()["kv_tokens"] == held


def test_an_engine_keeps_its_sessions_within_the_budget(draft_model):
    from specdec.engine.api import DraftRequest
    from specdec.engine.drafter import DrafterEngine
    from specdec.sampling import SamplingParams

    engine = DrafterEngine(draft_model, SessionConfig(max_kv_tokens=10))
    for session in ("s1", "s2"):  # 6 + 6 context tokens: more than 10 together
        engine.draft(DraftRequest(session, 0, [1, 2, 3, 4, 5, 6], [-1], SamplingParams(), seed=1))
    stats = engine.stats()
    assert "s1" not in engine.sessions and "s2" in engine.sessions
    assert stats["budget_evictions"] == 1 and 0 < stats["kv_tokens"] <= 10

"""Request records in both stores: created once (never over another), taken over by compare-and-set,
kept for the TTL (memory: bounded too), owners and leases round-trip (old records still load), and a
Redis outage is StoreUnavailable naming the store, never the URL, logged once per outage."""

from __future__ import annotations

import json
import logging

import pytest

from orchestrator.store import (
    STORE_DOWN,
    MemoryStore,
    RedisStore,
    RequestRecord,
    open_store,
    redacted_url,
)
from specdec.errors import StoreUnavailable
from specdec.rpc.security import ANONYMOUS
from tests.redis_server import RedisServer

OWNER = "token:aaa"


def _record(request_id: str = "req-1", tokens: list[int] | None = None,
            owner: str = OWNER) -> RequestRecord:
    return RequestRecord(request_id=request_id, status="running", prompt_ids=[1, 2],
                         token_ids=list(tokens or [3]), params={"method": "token"}, seed=7, owner=owner,
                         lease_until=123.5)


@pytest.fixture(params=["memory", "redis"])
async def store(request):
    if request.param == "memory":
        backend = MemoryStore()
    else:
        backend = RedisStore(request.getfixturevalue("redis_url"), ttl_seconds=60,
                             prefix=f"test-records-{request.node.name}")
    yield backend
    await backend.close()


async def test_create_never_overwrites(store):
    first = _record(tokens=[3, 4, 5])
    assert await store.create_request(first)
    stored = await store.get_request("req-1", OWNER)
    assert stored == first and stored.owner == "token:aaa" and stored.lease_until == 123.5
    assert not await store.create_request(_record(tokens=[9]))
    assert await store.get_request("req-1", OWNER) == stored  # untouched, updated_at included


async def test_request_ids_are_scoped_to_their_owner(store):
    """Another owner's request_id is another record: created beside it, neither seen nor touched."""
    mine = _record(tokens=[3, 4, 5])
    assert await store.create_request(mine)
    assert await store.get_request("req-1", "token:bbb") is None
    assert await store.get_request("req-1") is None  # nor by the anonymous caller
    theirs = _record(tokens=[9], owner="token:bbb")
    assert await store.create_request(theirs)
    assert await store.put_request(_record(tokens=[9, 8], owner="token:bbb"))
    assert (await store.get_request("req-1", "token:bbb")).token_ids == [9, 8]
    assert await store.get_request("req-1", OWNER) == mine  # untouched, updated_at included
    anonymous = _record(tokens=[7], owner=ANONYMOUS)
    assert await store.create_request(anonymous)
    assert (await store.get_request("req-1")).token_ids == [7]


async def test_replace_is_compare_and_set(store):
    await store.create_request(_record())
    seen = await store.get_request("req-1", OWNER)
    mine = _record(tokens=[3, 1])
    assert await store.replace_request(mine, if_updated_at=seen.updated_at)
    theirs = _record(tokens=[3, 2])
    assert not await store.replace_request(theirs, if_updated_at=seen.updated_at)  # stale version
    assert (await store.get_request("req-1", OWNER)).token_ids == [3, 1]
    assert not await store.replace_request(_record("missing"), if_updated_at=0.0)
    assert await store.get_request("missing", OWNER) is None


async def test_ping_when_up(store):
    await store.ping()


def test_records_from_before_owners_and_leases_still_load():
    old = {"request_id": "r", "status": "running", "prompt_ids": [1], "token_ids": [2], "params": {},
           "seed": 1, "stats": {}, "finish_reason": None, "text": "", "error": None, "updated_at": 5.0}
    record = RequestRecord.from_json(json.dumps(old))
    assert (record.owner, record.lease_until) == (ANONYMOUS, 0.0)
    newer = RequestRecord.from_json(json.dumps({**old, "a_field_from_a_newer_version": 1}))
    assert newer == record


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def test_memory_records_expire_after_their_ttl():
    clock = Clock()
    store = MemoryStore(ttl_seconds=10, clock=clock)
    await store.create_request(_record("a"))
    clock.now += 6
    await store.put_request(_record("a", [3, 4]))  # progress renews the TTL
    await store.create_request(_record("b"))
    clock.now += 6  # a: 6 s after its last write; b: 6 s
    assert (await store.get_request("a", OWNER)).token_ids == [3, 4]
    clock.now += 4.5
    assert await store.get_request("a", OWNER) is None and await store.get_request("b", OWNER) is None
    assert len(store) == 0
    assert await store.create_request(_record("a"))  # an expired id is free again


async def test_memory_store_is_bounded_least_recently_written_first():
    store = MemoryStore(max_requests=3)
    for name in "abc":
        await store.create_request(_record(name))
    await store.put_request(_record("a", [3, 4]))  # a is now the most recently written
    await store.create_request(_record("d"))
    assert len(store) == 3
    assert await store.get_request("b", OWNER) is None
    assert [(await store.get_request(n, OWNER)) is not None for n in "acd"] == [True, True, True]


async def test_redis_honours_the_ttl(redis_url):
    store = RedisStore(redis_url, ttl_seconds=7, prefix="test-ttl")
    try:
        await store.create_request(_record("t"))
        ttl = await store._redis.ttl(store._request_key(OWNER, "t"))
        assert 0 < ttl <= 7
        await store._redis.expire(store._request_key(OWNER, "t"), 2)
        await store.put_request(_record("t", [3, 4]))  # progress renews it
        assert 2 < await store._redis.ttl(store._request_key(OWNER, "t")) <= 7
    finally:
        await store._redis.delete(store._request_key(OWNER, "t"))
        await store.close()


def test_open_store_passes_the_ttl_to_both_backends():
    memory = open_store(None, ttl_seconds=30)
    assert isinstance(memory, MemoryStore) and memory.ttl_seconds == 30
    redis_store = open_store("redis://127.0.0.1:1/0", ttl_seconds=40)
    assert isinstance(redis_store, RedisStore) and redis_store.ttl_seconds == 40
    with pytest.raises(ValueError, match="store_url") as info:
        open_store("postgres://user:hunter2@db/x")
    assert "hunter2" not in str(info.value)


def test_redacted_url():
    assert redacted_url("redis://:hunter2@cache:6379/0") == "redis://:***@cache:6379/0"
    assert redacted_url("redis://me:hunter2@cache/1") == "redis://me:***@cache/1"
    assert redacted_url("redis://cache:6379/0") == "redis://cache:6379/0"


async def test_a_redis_outage_is_store_unavailable_logged_once(tmp_path, caplog):
    server = RedisServer(tmp_path).start()
    store = RedisStore(server.url, ttl_seconds=60, prefix="test-outage", timeout_seconds=1.0)
    caplog.set_level(logging.INFO, logger="orchestrator.store")
    try:
        assert await store.create_request(_record())
        await store.ping()
        server.kill()
        calls = [store.ping(), store.get_request("req-1", OWNER), store.put_request(_record()),
                 store.create_request(_record("other")), store.replace_request(_record(), if_updated_at=0.0),
                 store.add_calibration("pair", {"x": 1}), store.get_calibration("pair")]
        for call in calls:
            with pytest.raises(StoreUnavailable) as info:
                await call
            assert str(info.value) == STORE_DOWN  # names the store, not its address
            assert str(server.port) not in str(info.value)
        down = [r for r in caplog.records if "unavailable" in r.getMessage()]
        assert len(down) == 1 and str(server.port) in down[0].getMessage()  # the address: log only

        server.start()  # same port, empty (no persistence)
        await store.ping()
        assert await store.get_request("req-1", OWNER) is None
        assert sum("reachable again" in r.getMessage() for r in caplog.records) == 1
    finally:
        await store.close()
        server.stop()

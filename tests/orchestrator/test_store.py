"""Store backends: request records and calibration counters round-trip (memory and a real Redis)."""

from __future__ import annotations

import pytest

from orchestrator.store import MemoryStore, RedisStore, RequestRecord, open_store


def _record(request_id: str = "req-1", status: str = "running") -> RequestRecord:
    return RequestRecord(
        request_id=request_id,
        status=status,
        prompt_ids=[1, 2, 3],
        token_ids=[4, 0, 5],
        params={"method": "rd", "k": 3, "a": 0.25,
                "sampling": {"temperature": 0.7, "top_k": 0, "top_p": 0.9}},
        seed=2**62 + 5,
        stats={"iterations": 2, "accepted_per_position": [1, 0], "seconds": 0.5},
        text="t4 t0 t5",
    )


@pytest.fixture(params=["memory", pytest.param("redis", marks=pytest.mark.slow)])  # redis: a server process
async def store(request):
    if request.param == "memory":
        backend = MemoryStore()
    else:
        backend = RedisStore(request.getfixturevalue("redis_url"), ttl_seconds=60, prefix="test-store")
    yield backend
    await backend.close()


async def test_request_round_trip(store):
    assert await store.get_request("missing") is None
    record = _record()
    await store.put_request(record)
    got = await store.get_request("req-1")
    assert got is not None and got.updated_at > 0
    assert got == record  # record.updated_at was set by put_request too
    record.status, record.token_ids = "done", [4, 0, 5, 1]
    await store.put_request(record)
    got = await store.get_request("req-1")
    assert (got.status, got.token_ids) == ("done", [4, 0, 5, 1])


async def test_calibration_counters_add_up(store):
    pair = "draft|target"
    assert await store.get_calibration(pair) == {}
    await store.add_calibration(pair, {"token:drafted_tokens": 4, "token:accepted_tokens": 3})
    await store.add_calibration(pair, {"token:drafted_tokens": 2, "token:rank_hits@0": 1})
    await store.add_calibration("other|pair", {"token:drafted_tokens": 100})
    assert await store.get_calibration(pair) == {
        "token:drafted_tokens": 6, "token:accepted_tokens": 3, "token:rank_hits@0": 1,
    }


async def test_redis_records_survive_a_new_client(redis_url):
    first = RedisStore(redis_url, prefix="test-survive")
    await first.put_request(_record("r-survive"))
    await first.close()
    second = RedisStore(redis_url, prefix="test-survive")
    try:
        got = await second.get_request("r-survive")
        assert got is not None and got.token_ids == [4, 0, 5]
    finally:
        await second.close()


def test_open_store():
    assert isinstance(open_store(None), MemoryStore)
    assert isinstance(open_store("redis://127.0.0.1:1/0"), RedisStore)
    with pytest.raises(ValueError, match="store_url"):
        open_store("postgres://x")

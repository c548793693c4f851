"""A hung or restarted Redis, in process (a real redis-server, SIGSTOP / SIGCONT, kill -9 and restart).

Every store operation is bounded by the store timeout, so during a hang a new request fails fast
(StoreUnavailable → UNAVAILABLE); a run in flight generates on, holding its chunks back until a
save succeeds, and either finishes once Redis is back (every token, its record saved) or, past the
outage grace, ends StoreUnavailable with its last saved record, which Resume continues exactly; a
Redis restarted on the same port costs no request (a dropped pooled connection is retried once).
"""

from __future__ import annotations

import asyncio
import re
import time

import pytest

from orchestrator.store import RedisStore, RequestRecord, open_store
from specdec.errors import StillRunning, StoreUnavailable
from specdec.generation import GenerationRequest
from specdec.sampling import SamplingParams
from tests.redis_server import RedisServer

pytestmark = pytest.mark.timeout(120)

TIMEOUT_S = 0.25  # the store's bound per operation in these tests
SLACK_S = 1.0  # a busy 2-core machine's scheduling
N = 80  # long enough that the run is still going when Redis wakes up
HANG_S = 1.5
SAMPLE = SamplingParams(temperature=1.0)


def _request(request_id: str, seed: int = 11, n: int = N) -> GenerationRequest:
    return GenerationRequest(prompt_ids=[1, 2, 3], max_new_tokens=n, method="token", k=3, sampling=SAMPLE,
                             seed=seed, stop_token_ids=[], request_id=request_id)


@pytest.fixture
def redis(tmp_path):
    server = RedisServer(tmp_path).start()
    yield server
    server.stop()


def _settings(redis: RedisServer, **config) -> dict:
    """The orchestrator's settings for a Redis store bounded by TIMEOUT_S (config.store_timeout_s)."""
    return {"store_url": redis.url, "store_timeout_s": TIMEOUT_S, **config}


async def test_every_store_operation_fails_within_the_bound_while_redis_hangs(redis):
    store = open_store(redis.url, ttl_seconds=60, timeout_seconds=TIMEOUT_S)
    assert isinstance(store, RedisStore) and store.timeout_seconds == TIMEOUT_S
    record = RequestRecord(request_id="r", status="running", prompt_ids=[1], token_ids=[2], params={}, seed=1)
    try:
        assert await store.create_request(record)
        with redis.paused():
            calls = {"ping": store.ping(), "get": store.get_request("r"), "put": store.put_request(record),
                     "create": store.create_request(record),
                     "replace": store.replace_request(record, if_updated_at=record.updated_at),
                     "add_calibration": store.add_calibration("pair", {"x": 1}),
                     "get_calibration": store.get_calibration("pair")}
            for name, call in calls.items():
                started = time.monotonic()
                with pytest.raises(StoreUnavailable):
                    await asyncio.wait_for(call, 30)
                assert time.monotonic() - started < TIMEOUT_S + SLACK_S, name
        await store.ping()  # back at once
    finally:
        await store.close()


async def test_a_new_request_fails_fast_while_redis_hangs(make_orchestrator, redis):
    orch = make_orchestrator(**_settings(redis))
    try:
        assert len((await orch.generate(_request("before", n=4))).token_ids) == 4
        with redis.paused():
            started = time.monotonic()
            with pytest.raises(StoreUnavailable, match=r"request store \(Redis\) unavailable"):
                await asyncio.wait_for(orch.generate(_request("during", n=4)), 30)
            assert time.monotonic() - started < TIMEOUT_S + SLACK_S
        assert len((await orch.generate(_request("after", n=4))).token_ids) == 4
    finally:
        await orch.close()


async def test_a_stream_generates_through_a_hang_and_saves_when_redis_is_back(make_orchestrator, redis):
    """Within the grace: the run goes on generating (its saves time out, its chunks wait), and once
    Redis answers again the held-back tokens go out, the result is the undisturbed run's and the
    record is saved done."""
    iterations: list[float] = []
    orch = make_orchestrator(on_iteration=lambda _: iterations.append(time.monotonic()),
                             **_settings(redis, store_outage_grace_s=30.0))
    try:
        reference = await orch.generate(_request("reference"))
        stream = orch.generate_stream(_request("through"))
        received = list((await stream.__anext__()).token_ids)
        arrivals: list[float] = []

        async def rest():
            result = None
            async for chunk in stream:
                arrivals.append(time.monotonic())
                received.extend(chunk.token_ids)
                result = chunk.result or result
            return result

        with redis.paused():
            stopped = time.monotonic()
            task = asyncio.create_task(rest())
            # HANG_S at least, and until the run has made 3 iterations in the hang (each waits for a
            # store timeout: a slow machine may need longer than HANG_S for them)
            await _hang_until(lambda: sum(t > stopped for t in iterations) >= 3, stopped,
                              "the run stalled while Redis hung: fewer than 3 iterations")
            assert not arrivals, "a chunk went out although its progress was not saved"
        result = await asyncio.wait_for(task, 60)
        assert received == reference.token_ids and result.token_ids == reference.token_ids
        record = await orch.store.get_request("through")
        assert (record.status, record.token_ids) == ("done", reference.token_ids)
    finally:
        await orch.close()


async def test_a_run_that_ends_during_a_hang_sends_its_result_once_it_is_saved(make_orchestrator, redis):
    """The final chunk never goes out before the record is saved done: a run that finishes while
    Redis hangs waits (trying the save again) and sends its result once Redis answers."""
    iterations: list[float] = []
    emitted: dict[str, int] = {}  # new tokens per request id, as its iterations report them

    def on_iteration(record) -> None:
        iterations.append(time.monotonic())
        emitted[record.request_id] = emitted.get(record.request_id, 0) + len(record.emitted)

    orch = make_orchestrator(on_iteration=on_iteration, **_settings(redis, store_outage_grace_s=30.0))
    try:
        reference = await orch.generate(_request("reference", n=8))
        stream = orch.generate_stream(_request("ends", n=8))
        received = list((await stream.__anext__()).token_ids)
        with redis.paused():
            stopped = time.monotonic()
            task = asyncio.create_task(_drain(stream))
            # HANG_S at least, and until the run's last iteration is done (the few left are each slowed
            # by a store timeout: a slow machine may need longer than HANG_S for them)
            await _hang_until(lambda: emitted.get("ends", 0) >= 8, stopped,
                              "the run did not end during the hang")
            assert not task.done(), "the result went out before it was saved"
            woke = time.monotonic()
        chunks = await asyncio.wait_for(task, 30)
        assert iterations[-1] < woke  # the run had ended during the hang: only its save waited for Redis
        assert time.monotonic() - woke < 2 * TIMEOUT_S + SLACK_S  # saved at the next try
        received += [t for chunk in chunks for t in chunk.token_ids]
        assert received == reference.token_ids and chunks[-1].result.token_ids == reference.token_ids
        assert len(chunks) == 1  # everything since the first chunk, in the one chunk sent once saved
        record = await orch.store.get_request("ends")
        assert (record.status, record.token_ids) == ("done", reference.token_ids)
    finally:
        await orch.close()


async def test_a_stream_past_the_grace_ends_unavailable_and_resumes_exactly(make_orchestrator, redis):
    """Past the grace the stream ends UNAVAILABLE within a bound, the client having got only saved
    tokens; once Redis is back, Resume continues from the last saved record to the undisturbed result."""
    grace = 1.0
    orch = make_orchestrator(**_settings(redis, store_outage_grace_s=grace, resume_lease_seconds=1.0))
    try:
        reference = await orch.generate(_request("reference"))
        stream = orch.generate_stream(_request("cut"))
        received = list((await stream.__anext__()).token_ids)
        with redis.paused():
            started = time.monotonic()
            with pytest.raises(StoreUnavailable, match="Resume continues it") as info:
                async with asyncio.timeout(30):
                    async for chunk in stream:
                        received.extend(chunk.token_ids)
            took = time.monotonic() - started
            # the grace, the save attempt that crossed it, the attempt of the iteration before
            assert grace <= took < grace + 2 * TIMEOUT_S + SLACK_S, took  # it generated on meanwhile
        assert "store_outage_grace_s 1" in str(info.value)
        assert 0 < len(received) < N and received == reference.token_ids[: len(received)]

        chunks = await _resume(orch, "cut")
        stored = chunks[0].token_ids  # the last saved progress: at least what the client got
        assert stored[: len(received)] == received
        assert [t for chunk in chunks for t in chunk.token_ids] == reference.token_ids
        assert chunks[-1].result.token_ids == reference.token_ids
        assert (await orch.store.get_request("cut")).status == "done"
    finally:
        await orch.close()


async def test_a_restarted_redis_costs_no_request(make_orchestrator, redis):
    """kill -9 and a restart on the same port: the pooled connections are dead; the next requests
    (several at once, so several pooled connections are met) succeed on fresh ones."""
    orch = make_orchestrator(**_settings(redis))
    try:
        await asyncio.gather(*(orch.generate(_request(f"warm-{i}", n=4)) for i in range(4)))
        redis.kill()
        redis.start()  # same port, empty
        results = await asyncio.gather(*(orch.generate(_request(f"after-{i}", n=4)) for i in range(4)))
        assert [len(r.token_ids) for r in results] == [4] * 4
        assert (await orch.store.get_request("after-0")).status == "done"
    finally:
        await orch.close()


@pytest.mark.parametrize("path", [("serve", "orchestrator"), ("up",)], ids=["serve", "up"])
def test_the_store_bounds_are_options_with_the_configs_defaults(path):
    from typer.testing import CliRunner

    from orchestrator.config import OrchestratorConfig
    from specdec.cli import app

    result = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": "220", "NO_COLOR": "1"})
    assert result.exit_code == 0, result.output
    text = re.sub(r"\s+", " ", result.output)
    config = OrchestratorConfig()
    assert f"$SPECDEC_STORE_TIMEOUT_S, else {config.store_timeout_s:g}." in text
    assert f"$SPECDEC_STORE_OUTAGE_GRACE_S, else {config.store_outage_grace_s:g}." in text


async def _drain(stream) -> list:
    return [chunk async for chunk in stream]


async def _hang_until(condition, since: float, what: str, wait_s: float = 30.0) -> None:
    """Keep Redis hung (the caller's block) for HANG_S since `since` at least, and until `condition`
    holds: bounded by `wait_s`, then AssertionError(`what`)."""
    deadline = since + wait_s
    while time.monotonic() - since < HANG_S or not condition():
        assert time.monotonic() < deadline, f"{what} (within {wait_s:g} s)"
        await asyncio.sleep(0.05)


async def _resume(orch, request_id: str, wait_s: float = 15.0) -> list:
    """Resume's chunks, retried (bounded) while the cut run's last lease has not run out."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return [chunk async for chunk in orch.resume_stream(request_id)]
        except StillRunning:
            assert time.monotonic() < deadline, "the cut run's record stayed leased"
            await asyncio.sleep(0.1)

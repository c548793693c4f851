"""Slow readers and abandoned streams, in process (admission.paced, CallerLimit): a stream whose reader
stops reading pauses without its request slot, so other requests run meanwhile; one left unread past
the idle timeout is closed, its sessions and lease freed, and resumes exactly; a caller over its cap
is refused at once. The same over real gRPC: tests/services/test_slow_grpc_readers.py; over HTTP:
tests/http/test_aborted_streams.py."""

from __future__ import annotations

import asyncio
import time

import pytest

from orchestrator.admission import StreamIdle
from specdec.errors import Overloaded
from specdec.generation import GenerationRequest
from specdec.rpc.status import status_for
from specdec.sampling import SamplingParams

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(120)]

WAIT_S = 30.0  # bound of every wait (never reached unless something is broken)
READERS = 4  # streams opened and never read past their first chunk
LONG = 100  # new tokens of a non-reader's request (the tiny models' window is 128): 4x the well-behaved one's


def _request(seed: int, n: int, request_id: str | None = None) -> GenerationRequest:
    return GenerationRequest(prompt_ids=[1, 2, 3], max_new_tokens=n, method="token", k=2, seed=seed,
                             sampling=SamplingParams(temperature=1.0), stop_token_ids=[],
                             request_id=request_id)


async def _wait_until(condition, what: str) -> None:
    try:
        async with asyncio.timeout(WAIT_S):
            while not condition():
                await asyncio.sleep(0.01)
    except TimeoutError:
        raise AssertionError(f"not within {WAIT_S} s: {what}") from None


def _sessions(engines) -> tuple[int, int]:
    return engines["draft"].stats()["active_sessions"], engines["verifier"].stats()["active_sessions"]


async def _timed_generate(orch, request: GenerationRequest) -> float:
    began = time.perf_counter()
    result = await orch.generate(request)
    assert len(result.token_ids) == request.max_new_tokens
    return time.perf_counter() - began


async def test_readers_that_stop_reading_do_not_hold_the_slots(make_orchestrator, engines):
    orch = make_orchestrator(max_active_requests=1, queue_timeout_s=WAIT_S, stream_idle_timeout_s=0)
    alone = await _timed_generate(orch, _request(seed=9, n=24))  # one request's time, undisturbed
    streams = [orch.generate_stream(_request(seed=i, n=LONG)) for i in range(READERS)]
    try:
        for stream in streams:  # each gets the only slot in turn, sends a chunk, then is not read
            await asyncio.wait_for(anext(stream), WAIT_S)
        await _wait_until(lambda: orch.admission_stats()["paused"] == READERS, "every unread stream paused")
        assert orch.admission_stats()["active"] == 0  # paused streams hold no slot...
        busy = await asyncio.wait_for(_timed_generate(orch, _request(seed=9, n=24)), WAIT_S)
        # ...so a well-behaved request is delayed by at most about one request's time
        assert busy < 2 * alone + 1.0, (busy, alone)
        for stream in streams:  # the paused runs continue where they stopped once read again
            chunks = [chunk async for chunk in stream]
            assert chunks[-1].result is not None and len(chunks[-1].result.token_ids) == LONG
    finally:
        for stream in streams:
            await stream.aclose()
    stats = orch.admission_stats()
    assert (stats["active"], stats["paused"], stats["waiting"]) == (0, 0, 0)
    await orch.close()


async def test_a_paused_stream_gives_the_same_tokens_as_one_read_at_once(make_orchestrator):
    orch = make_orchestrator(max_active_requests=1, queue_timeout_s=WAIT_S, stream_idle_timeout_s=0)
    expected = (await orch.generate(_request(seed=3, n=60))).token_ids
    stream = orch.generate_stream(_request(seed=3, n=60))
    tokens = list((await anext(stream)).token_ids)
    await _wait_until(lambda: orch.admission_stats()["paused"] == 1, "the unread stream paused")
    other = asyncio.create_task(orch.generate(_request(seed=4, n=30)))  # takes the slot meanwhile
    async with asyncio.timeout(WAIT_S):
        await other
        async for chunk in stream:
            tokens += chunk.token_ids
    assert tokens == expected
    await orch.close()


async def test_an_idle_stream_is_closed_freed_and_resumes_exactly(make_orchestrator, engines):
    before = _sessions(engines)
    orch = make_orchestrator(stream_idle_timeout_s=0.5)
    expected = (await orch.generate(_request(seed=5, n=LONG, request_id="whole"))).token_ids
    stream = orch.generate_stream(_request(seed=5, n=LONG, request_id="idle"))
    first = await anext(stream)
    await _wait_until(lambda: orch.admission_stats()["idle_closed"] == 1, "the idle stream closed")
    stats = orch.admission_stats()
    assert (stats["active"], stats["paused"]) == (0, 0)
    assert _sessions(engines) == before  # both engines' sessions released
    record = await orch.store.get_request("idle")
    assert record.status == "running" and record.lease_until == 0.0  # resumable at once
    received = list(first.token_ids)
    with pytest.raises(StreamIdle, match="took nothing for 0.5 s") as caught:
        async for chunk in stream:  # what was made before it closed, then the reason
            received += chunk.token_ids
    assert status_for(caught.value)[0].name == "RESOURCE_EXHAUSTED"
    assert received == record.token_ids  # every chunk made before the close was delivered
    resumed = await orch.resume("idle")
    assert resumed.token_ids == expected
    await orch.close()


async def test_a_caller_over_its_cap_is_refused_at_once(make_orchestrator):
    orch = make_orchestrator(max_requests_per_caller=2, stream_idle_timeout_s=0)
    held = [orch.generate_stream(_request(seed=i, n=LONG), owner="token:alice") for i in range(2)]
    try:
        for stream in held:
            await anext(stream)
        began = time.perf_counter()
        with pytest.raises(Overloaded, match=r"already has 2 requests open, the most "
                                             r"--max-requests-per-caller \(2\) allows"):
            await orch.generate(_request(seed=7, n=4), owner="token:alice")
        assert time.perf_counter() - began < 1.0  # refused before waiting for anything
        assert len((await orch.generate(_request(seed=7, n=4), owner="token:bob")).token_ids) == 4
        # an anonymous caller is counted by its address (the key its door passes)
        assert len((await orch.generate(_request(seed=7, n=4), caller="peer:10.0.0.1")).token_ids) == 4
        assert orch.admission_stats()["caller_refused"] == 1
    finally:
        for stream in held:
            await stream.aclose()
    assert len((await orch.generate(_request(seed=7, n=4), owner="token:alice")).token_ids) == 4
    await orch.close()


async def test_a_stream_closed_while_paused_or_running_frees_everything_at_once(make_orchestrator, engines):
    before = _sessions(engines)
    orch = make_orchestrator(stream_idle_timeout_s=0)
    paused = orch.generate_stream(_request(seed=1, n=LONG))
    await anext(paused)
    await _wait_until(lambda: orch.admission_stats()["paused"] == 1, "the unread stream paused")
    running = orch.generate_stream(_request(seed=2, n=LONG))
    await anext(running)
    for stream in (paused, running):
        await stream.aclose()
    stats = orch.admission_stats()
    assert (stats["active"], stats["paused"]) == (0, 0) and _sessions(engines) == before
    await orch.close()


async def test_a_reader_cancelled_twice_still_frees_everything(make_orchestrator, engines):
    """A reader cancelled again while its stream closes (Starlette's cancel scope does that) must not
    cut the run's clean-up short: the engines' sessions are released all the same."""
    before = _sessions(engines)
    orch = make_orchestrator(stream_idle_timeout_s=0)
    stream = orch.generate_stream(_request(seed=1, n=LONG))
    await anext(stream)

    reading = asyncio.Event()

    async def read() -> None:
        reading.set()
        async for _ in stream:  # reads at once: it waits for the run's next chunk
            pass

    reader = asyncio.create_task(read())
    # The reader is waiting in the stream (it suspends there before this wakes), and the run is far
    # from its end whatever the machine's speed (a fixed sleep here let a fast one finish the stream).
    await asyncio.wait_for(reading.wait(), WAIT_S)
    reader.cancel()
    await asyncio.sleep(0)  # the stream is closing: its run's clean-up has started
    reader.cancel()
    with pytest.raises(asyncio.CancelledError):
        await reader
    await stream.aclose()
    await _wait_until(lambda: _sessions(engines) == before and orch.admission_stats()["active"] == 0,
                      "the sessions released")
    await orch.close()

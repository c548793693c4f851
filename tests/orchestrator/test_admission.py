"""Admission control: the orchestrator's request slots, an engine's full KV budget, and Overloaded
crossing gRPC both ways as RESOURCE_EXHAUSTED (told apart from an oversized message)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from orchestrator.admission import RequestSlots
from orchestrator.config import OrchestratorConfig
from specdec.engine.api import DraftRequest
from specdec.engine.sessions import SessionConfig
from specdec.errors import Overloaded
from specdec.generation import GenerationRequest
from specdec.rpc.status import OVERLOADED_PREFIX, RemoteError, error_from_status, status_for
from specdec.sampling import SamplingParams

WAIT_S = 20.0  # bound of every wait (never reached unless something is broken)
FIRST_TOKENS = 64  # a first request long enough to still run when the second one queues (one loop tick)


def _request(seed: int = 1, max_new_tokens: int = 6) -> GenerationRequest:
    return GenerationRequest(prompt_ids=[1, 2, 3], max_new_tokens=max_new_tokens, method="token", k=2,
                             seed=seed, stop_token_ids=[])


async def _wait_until(condition, what: str) -> None:
    async with asyncio.timeout(WAIT_S):
        while not condition():
            await asyncio.sleep(0.01)


# ------------------------------------------------------------------------------------------------
# request slots


async def test_slots_admit_up_to_the_limit_then_reject_after_the_timeout():
    slots = RequestSlots(limit=2, timeout_s=0.05)
    await slots.acquire()
    await slots.acquire()
    with pytest.raises(Overloaded, match=r"orchestrator busy: 2 requests running and 0 waiting \(waited "
                                         r"0.05 s for a slot\); retry later or raise --max-active-requests"):
        await slots.acquire()
    assert (slots.active, slots.waiting, slots.rejected) == (2, 0, 1)
    slots.release()
    await slots.acquire()  # a freed slot is taken at once
    assert slots.active == 2


async def test_a_freed_slot_goes_to_the_waiters_in_arrival_order():
    slots = RequestSlots(limit=1, timeout_s=WAIT_S)
    await slots.acquire()
    order: list[str] = []

    async def request(name: str) -> None:
        async with slots.slot():
            order.append(name)

    first = asyncio.create_task(request("first"))
    await _wait_until(lambda: slots.waiting == 1, "the first waiter")
    second = asyncio.create_task(request("second"))
    await _wait_until(lambda: slots.waiting == 2, "the second waiter")
    slots.release()
    async with asyncio.timeout(WAIT_S):
        await asyncio.gather(first, second)
    assert order == ["first", "second"] and (slots.active, slots.waiting, slots.rejected) == (0, 0, 0)


async def test_a_cancelled_waiter_gives_its_place_up():
    slots = RequestSlots(limit=1, timeout_s=WAIT_S)
    await slots.acquire()
    waiter = asyncio.create_task(slots.acquire())
    await _wait_until(lambda: slots.waiting == 1, "the waiter")
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert slots.waiting == 0
    slots.release()
    assert slots.active == 0


def test_the_config_limits_and_their_environment_variables(monkeypatch):
    config = OrchestratorConfig()
    assert (config.max_active_requests, config.queue_timeout_s) == (64, 60.0)
    monkeypatch.setenv("SPECDEC_MAX_ACTIVE_REQUESTS", "3")
    monkeypatch.setenv("SPECDEC_QUEUE_TIMEOUT_S", "0.5")
    config = OrchestratorConfig()
    assert (config.max_active_requests, config.queue_timeout_s) == (3, 0.5)
    with pytest.raises(ValueError):
        OrchestratorConfig(max_active_requests=0)


# ------------------------------------------------------------------------------------------------
# the orchestrator


async def test_a_second_request_is_refused_while_the_only_slot_is_held(make_orchestrator):
    orch = make_orchestrator(max_active_requests=1, queue_timeout_s=0.05)
    stream = orch.generate_stream(_request())
    first = await stream.__anext__()  # the first request runs (a stream not read pauses without its slot)
    assert first.token_ids and first.result is None
    await stream.aclose()  # closing the stream frees its slot at once
    assert orch.admission_stats()["active"] == 0
    async with orch.admission.slot():  # another request holds the only slot
        with pytest.raises(Overloaded, match="orchestrator busy: 1 requests running and 0 waiting"):
            await orch.generate(_request(seed=2))
        with pytest.raises(Overloaded):
            await _drain(orch.resume_stream("any-id"))  # resuming needs a slot too
    assert orch.admission_stats() == {"active": 0, "waiting": 0, "rejected": 2, "limit": 1,
                                      "paused": 0, "idle_closed": 0, "caller_refused": 0}
    result = await orch.generate(_request(seed=2))
    assert len(result.token_ids) == 6
    await orch.close()


async def test_a_waiting_request_runs_once_the_first_finishes(make_orchestrator):
    orch = make_orchestrator(max_active_requests=1, queue_timeout_s=WAIT_S)
    stream = orch.generate_stream(_request(max_new_tokens=FIRST_TOKENS))
    await stream.__anext__()
    # Read on at once: a stream whose reader stops pauses and hands its slot over (admission.paced),
    # so only a first request that is read keeps its slot while the second one queues.
    reader = asyncio.create_task(_drain(stream))
    waiting = asyncio.create_task(orch.generate(_request(seed=2)))
    await _wait_until(lambda: orch.admission_stats()["waiting"] == 1, "the second request to queue")
    assert not waiting.done() and not reader.done()
    rest = await reader  # the first request finishes: its slot passes to the waiting one
    assert rest[-1].result is not None
    async with asyncio.timeout(WAIT_S):
        result = await waiting
    assert len(result.token_ids) == 6
    assert orch.admission_stats() == {"active": 0, "waiting": 0, "rejected": 0, "limit": 1,
                                      "paused": 0, "idle_closed": 0, "caller_refused": 0}
    await orch.close()


async def test_a_failed_request_frees_its_slot(make_orchestrator):
    orch = make_orchestrator(max_active_requests=1, queue_timeout_s=0.05)
    with pytest.raises(Exception, match="prompt"):
        await orch.generate(GenerationRequest(prompt_ids=[99], method="token"))  # out of vocabulary
    assert orch.admission_stats()["active"] == 0
    assert len((await orch.generate(_request())).token_ids) == 6
    await orch.close()


async def _drain(stream) -> list:
    return [chunk async for chunk in stream]


# ------------------------------------------------------------------------------------------------
# Overloaded over gRPC


def test_overloaded_maps_to_resource_exhausted_and_back():
    code, details = status_for(Overloaded("KV budget full: 10 of 10 tokens held by 2 busy sessions"))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert details == OVERLOADED_PREFIX + "KV budget full: 10 of 10 tokens held by 2 busy sessions"
    back = error_from_status(code, details, "127.0.0.1:50052")
    assert isinstance(back, Overloaded)
    assert str(back) == "127.0.0.1:50052: KV budget full: 10 of 10 tokens held by 2 busy sessions"
    # the orchestrator passes an engine's Overloaded on: the prefix is never doubled, and its
    # clients get the engine's name, not its address (that stays in str(), for the log)
    assert status_for(back)[1] == f"{OVERLOADED_PREFIX}upstream service: KV budget full: 10 of 10 tokens " \
                                  "held by 2 busy sessions"
    named = error_from_status(code, details, "127.0.0.1:50052", service="verifier")
    assert status_for(named)[1] == f"{OVERLOADED_PREFIX}verifier: KV budget full: 10 of 10 tokens held by " \
                                   "2 busy sessions"


def test_an_oversized_message_is_still_a_remote_error_with_the_hint():
    error = error_from_status(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              "Received message larger than max (5000 vs. 4000)", "127.0.0.1:50052")
    assert isinstance(error, RemoteError) and not isinstance(error, Overloaded)
    assert error.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "raise max_message_mb" in str(error)


async def test_a_full_engine_answers_resource_exhausted_and_the_client_raises_overloaded(loaded):
    from drafter_service.server import start_drafter_server
    from orchestrator.clients.grpc_client import GrpcDrafterClient
    from specdec.engine.drafter import DrafterEngine
    from specdec.rpc.grpc_support import stop_server

    engine = DrafterEngine(loaded["draft"], SessionConfig(max_sessions=1, admission_timeout_s=0))
    server, port = await start_drafter_server(engine)
    client = GrpcDrafterClient(f"127.0.0.1:{port}")
    request = DraftRequest("new", 0, [1, 2], [-1], SamplingParams(), seed=1)
    try:
        with engine.sessions.use("held", 0):  # the only session, busy
            with pytest.raises(Overloaded, match=r"127\.0\.0\.1:\d+: session limit full: 1 of 1 sessions"):
                await client.draft(request)
        assert engine.stats()["rejections"] == 1
        assert (await client.draft(request)).tokens  # "held" is idle now: it makes way
    finally:
        await client.close()
        await stop_server(server, 0)
        engine.sessions.close()


async def test_the_generation_service_answers_resource_exhausted_when_busy(make_orchestrator):
    from orchestrator.server import start_orchestrator_server
    from specdec.client import AsyncClient
    from specdec.rpc.grpc_support import stop_server

    orch = make_orchestrator(max_active_requests=1, queue_timeout_s=0)
    await orch.start()
    server, port = await start_orchestrator_server(orch)
    client = AsyncClient(f"127.0.0.1:{port}")
    try:
        async with orch.admission.slot():  # another request holds the only slot
            with pytest.raises(Overloaded, match="orchestrator busy: 1 requests running"):
                await client.generate(_request())
        assert len((await client.generate(_request())).token_ids) == 6
    finally:
        await client.close()
        await stop_server(server, 0)
        await orch.close()

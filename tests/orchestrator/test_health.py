"""Dependency-aware health (orchestrator.health): the orchestrator's gRPC health status follows its
verifier and store — NOT_SERVING while the verifier is down (from the start too), SERVING again once it
is back without an orchestrator restart — while a drafter that is down never makes it NOT_SERVING;
requests meanwhile get UNAVAILABLE "verifier not ready" at once, with no internal address. Real gRPC
servers on loopback, tiny models."""

from __future__ import annotations

import asyncio
import logging
import time

import grpc
import pytest

from orchestrator import health
from orchestrator.clients.grpc_client import GrpcDrafterClient, GrpcVerifierClient
from orchestrator.clients.inprocess import InProcessDrafterClient, InProcessVerifierClient
from orchestrator.config import OrchestratorConfig
from orchestrator.health import Dependencies
from orchestrator.server import start_orchestrator_server
from orchestrator.speculation import Orchestrator
from orchestrator.store import MemoryStore
from specdec.errors import PeerUnavailable, StoreUnavailable
from specdec.generation import GenerationRequest
from specdec.rpc.grpc_support import stop_server
from specdec.rpc.v1 import common_pb2, generation_pb2, generation_pb2_grpc

from .engine_servers import EngineServer, health_status, wait_health

pytestmark = pytest.mark.timeout(180)

REQUEST = GenerationRequest(prompt_ids=[1, 2, 3], max_new_tokens=6, seed=3, stop_token_ids=[])


def _proto_request(n: int = 6) -> generation_pb2.GenerationRequest:
    """n new tokens after [1, 2, 3], no stop token."""
    return generation_pb2.GenerationRequest(prompt_ids=common_pb2.TokenIds(ids=[1, 2, 3]), max_new_tokens=n,
                                            seed=3, stop_token_ids=common_pb2.TokenIds(ids=[]))


async def _generate(port: int, n: int = 6) -> generation_pb2.GenerationResult:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        return await stub.Generate(_proto_request(n), timeout=60)


async def _refused(port: int) -> tuple[grpc.StatusCode, str, float]:
    """(code, details, seconds) of a Generate that must fail."""
    start = time.monotonic()
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await _generate(port)
    return caught.value.code(), caught.value.details() or "", time.monotonic() - start


class SwitchableStore(MemoryStore):
    """A memory store whose ping fails while `down` (a Redis outage as the monitor sees it)."""

    down = False

    async def ping(self) -> None:
        if self.down:
            raise StoreUnavailable("request store (Redis) unavailable")


class DeadDrafter:
    """A drafter client that never answers."""

    address = "dead-drafter"

    async def info(self):
        raise PeerUnavailable("dead-drafter unavailable (injected)")

    draft = lookahead = info

    async def release(self, session_id: str) -> None:
        raise PeerUnavailable("dead-drafter unavailable (injected)")

    async def close(self) -> None:
        return None


# ------------------------------------------------------------------------------------------------
# the state object


def test_dependencies_log_once_per_change_and_say_why(caplog):
    deps = Dependencies(drafter=True)
    heard = []
    stop = deps.listen(lambda: heard.append(deps.serving))
    assert deps.status()["verifier"]["state"] == health.UNKNOWN and not deps.serving
    with caplog.at_level(logging.INFO, logger="orchestrator.health"):
        assert deps.update(deps.verifier, health.OK)
        assert not deps.update(deps.verifier, health.OK)
        assert deps.update(deps.drafter, health.UNREACHABLE, "down (1)")
        assert not deps.update(deps.drafter, health.UNREACHABLE, "down (2)")  # only the why changed
        assert deps.update(deps.drafter, health.INCOMPATIBLE, "vocabulary mismatch: a")
        assert deps.update(deps.drafter, health.INCOMPATIBLE, "vocabulary mismatch: b")  # another reason
    assert [r.getMessage() for r in caplog.records] == [
        "verifier ok (was unknown)", "drafter unreachable: down (1)",
        "drafter incompatible: vocabulary mismatch: a", "drafter incompatible: vocabulary mismatch: b"]
    assert heard == [True, True, True, True]
    assert deps.serving  # a drafter never decides health
    deps.update(deps.store, health.UNREACHABLE, "redis down")
    status = deps.status()
    assert status["serving"] is False and status["store"]["state"] == "unreachable"
    assert set(status) == {"serving", "verifier", "drafter", "store", "drafter_timeouts"}
    assert set(status["drafter"]) == {"state", "detail", "seconds"}
    stop()
    deps.update(deps.store, health.OK)
    assert len(heard) == 5  # the store's outage was heard, its recovery no longer
    with pytest.raises(ValueError, match="state must be one of"):
        deps.update(deps.store, "fine")


# ------------------------------------------------------------------------------------------------
# in-process rounds: store and drafter


async def test_store_down_means_not_serving_and_back(engines):
    store = SwitchableStore()
    orch = Orchestrator(InProcessDrafterClient(engines["draft"]),
                        InProcessVerifierClient(engines["verifier"]), OrchestratorConfig(pipeline=False),
                        store=store)
    assert await orch.check_dependencies() is True
    store.down = True
    assert await orch.check_dependencies() is False
    status = orch.dependency_status()
    assert status["store"] == {**status["store"], "state": "unreachable",
                               "detail": "request store (Redis) unavailable"}
    assert status["verifier"]["state"] == "ok"
    store.down = False
    assert await orch.check_dependencies() is True


async def test_a_dead_drafter_never_makes_it_not_serving(engines):
    orch = Orchestrator(DeadDrafter(), InProcessVerifierClient(engines["verifier"]),
                        OrchestratorConfig(pipeline=False, drafter_retry_seconds=0.0))
    assert await orch.check_dependencies() is True
    assert orch.dependency_status()["drafter"]["state"] == "unreachable"
    result = await orch.generate(REQUEST)
    assert len(result.token_ids) == 6 and result.stats.fallback_iterations == result.stats.iterations
    assert await orch.check_dependencies() is True


# ------------------------------------------------------------------------------------------------
# a served orchestrator over gRPC engines


async def test_health_follows_the_verifier_down_and_back(engines):
    """The default monitor interval (1 s): NOT_SERVING within 1-2 s of the verifier's loss, requests
    refused at once meanwhile, SERVING again after it restarts — the orchestrator never restarts."""
    verifier = await EngineServer("verifier").start(engines["verifier"])
    drafter = await EngineServer("drafter").start(engines["draft"])
    orch = Orchestrator(GrpcDrafterClient(drafter.address, timeout_s=30),
                        GrpcVerifierClient(verifier.address, timeout_s=30),
                        OrchestratorConfig(pipeline=False))
    server, port = await start_orchestrator_server(orch)
    try:
        await wait_health(port, "SERVING")
        assert len((await _generate(port)).token_ids) == 6

        await verifier.stop()
        took = await wait_health(port, "NOT_SERVING", timeout_s=10)
        assert took < 3.0, f"NOT_SERVING only after {took:.1f} s"
        for _ in range(3):
            code, details, seconds = await _refused(port)
            assert code == grpc.StatusCode.UNAVAILABLE and details.startswith("verifier not ready"), details
            assert verifier.address not in details and str(verifier.port) not in details
            assert seconds < 1.5
        assert orch.dependency_status()["verifier"]["state"] == "unreachable"

        await verifier.start(engines["verifier"])  # the same port: a supervisor restarted it
        took = await wait_health(port, "SERVING", timeout_s=15)
        assert len((await _generate(port)).token_ids) == 6
        assert orch.dependency_status()["serving"] is True
    finally:
        await stop_server(server, 0.5)
        await orch.close()
        await verifier.stop()
        await drafter.stop()
    assert await health_status_or_none(port) is None  # stopped: nothing listens


async def health_status_or_none(port: int) -> str | None:
    try:
        return await health_status(port)
    except grpc.aio.AioRpcError:
        return None


async def test_not_serving_from_the_start_until_the_verifier_answers(engines):
    """An orchestrator whose verifier is not up yet listens, NOT_SERVING, answers requests UNAVAILABLE
    "verifier not ready" at once, and turns SERVING by itself when the verifier comes."""
    verifier = EngineServer("verifier")
    await verifier.start(engines["verifier"])
    await verifier.stop()  # a port that was just free: nothing listens there now
    orch = Orchestrator(None, GrpcVerifierClient(verifier.address, timeout_s=30),
                        OrchestratorConfig(pipeline=False, health_interval_s=0.2))
    server, port = await start_orchestrator_server(orch)
    try:
        assert await health_status(port) == "NOT_SERVING"
        code, details, seconds = await _refused(port)
        assert code == grpc.StatusCode.UNAVAILABLE and details.startswith("verifier not ready"), details
        assert seconds < 1.5 and verifier.address not in details
        await asyncio.sleep(0.5)
        assert await health_status(port) == "NOT_SERVING"  # still waiting, still there
        await verifier.start(engines["verifier"])
        await wait_health(port, "SERVING", timeout_s=15)
        assert len((await _generate(port)).token_ids) == 6
    finally:
        await stop_server(server, 0.5)
        await orch.close()
        await verifier.stop()


async def test_a_request_in_flight_fails_unavailable_when_the_verifier_goes(engines):
    verifier = await EngineServer("verifier").start(engines["verifier"])
    orch = Orchestrator(None, GrpcVerifierClient(verifier.address, timeout_s=30),
                        OrchestratorConfig(pipeline=False, health_interval_s=0.2))
    server, port = await start_orchestrator_server(orch)
    try:
        await wait_health(port, "SERVING")
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = generation_pb2_grpc.GenerationServiceStub(channel).GenerateStream(_proto_request(100),
                                                                                     timeout=60)
            stream = call.__aiter__()
            await stream.__anext__()  # the request is running
            await verifier.stop()
            start = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                for _ in range(200):  # bounded: at most 100 tokens, one or more per chunk
                    await stream.__anext__()
            seconds = time.monotonic() - start
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE, caught.value
        assert seconds < 1.5
        await wait_health(port, "NOT_SERVING", timeout_s=5)
    finally:
        await stop_server(server, 0.5)
        await orch.close()
        await verifier.stop()

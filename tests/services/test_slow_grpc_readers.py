"""Slow readers over real gRPC (loopback): GenerateStream calls whose clients never read, with a small
flow-control window so that the server's writes block soon, do not keep a well-behaved client waiting
(their runs pause without a request slot); past the idle timeout their runs are closed, freed and
resumable exactly, and a call read again ends RESOURCE_EXHAUSTED after what it was sent; a caller
over its cap gets RESOURCE_EXHAUSTED at once. The slot logic in process: test_slow_readers.py in
tests/orchestrator."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import grpc  # noqa: E402
import pytest  # noqa: E402

from orchestrator.clients.inprocess import InProcessDrafterClient, InProcessVerifierClient  # noqa: E402
from orchestrator.config import OrchestratorConfig  # noqa: E402
from orchestrator.server import start_orchestrator_server  # noqa: E402
from orchestrator.speculation import Orchestrator  # noqa: E402
from specdec.engine.drafter import DrafterEngine  # noqa: E402
from specdec.engine.verifier import VerifierEngine  # noqa: E402
from specdec.generation import GenerationRequest  # noqa: E402
from specdec.rpc import generation_convert  # noqa: E402
from specdec.rpc.grpc_support import stop_server  # noqa: E402
from specdec.rpc.v1 import generation_pb2, generation_pb2_grpc  # noqa: E402
from specdec.runtime.loading import load_model  # noqa: E402
from specdec.runtime.tiny import save_tiny_model  # noqa: E402
from specdec.sampling import SamplingParams  # noqa: E402

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(180)]

WAIT_S = 30.0  # bound of every wait (never reached unless something is broken)
NON_READERS = 4
LONG = 1000  # new tokens a non-reader asks for (the models' window is 2048)
IDLE_TOKENS = 400  # more than the small window below lets through
# A client window of this many bytes (no BDP growth): the server's writes to a client that does not
# read block after a few dozen chunks, not after the megabytes gRPC would otherwise take in.
SMALL_WINDOW = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)]


@pytest.fixture(scope="module")
def engines(tmp_path_factory) -> tuple[DrafterEngine, VerifierEngine]:
    root = tmp_path_factory.mktemp("slow-readers")
    draft = save_tiny_model(root / "draft", vocab_size=6, seed=21, max_position_embeddings=2048)
    target = save_tiny_model(root / "target", vocab_size=6, seed=12, max_position_embeddings=2048)
    return DrafterEngine(load_model(draft, threads=1)), VerifierEngine(load_model(target, threads=1))


@asynccontextmanager
async def serving(engines, **config) -> AsyncIterator[tuple[Orchestrator, str]]:
    drafter, verifier = engines
    orchestrator = Orchestrator(InProcessDrafterClient(drafter), InProcessVerifierClient(verifier),
                                OrchestratorConfig(pipeline=False, draft_source="model", **config))
    server, port = await start_orchestrator_server(orchestrator)
    try:
        yield orchestrator, f"127.0.0.1:{port}"
    finally:
        await stop_server(server, 1.0)
        await orchestrator.close()


def _request(seed: int, n: int, request_id: str | None = None) -> generation_pb2.GenerationRequest:
    return generation_convert.generation_request_to_proto(GenerationRequest(
        prompt_ids=[1, 2, 3], max_new_tokens=n, method="token", k=2, seed=seed, stop_token_ids=[],
        sampling=SamplingParams(temperature=1.0), request_id=request_id))


async def _wait_until(condition, what: str) -> None:
    try:
        async with asyncio.timeout(WAIT_S):
            while not condition():
                await asyncio.sleep(0.02)
    except TimeoutError:
        raise AssertionError(f"not within {WAIT_S} s: {what}") from None


def _sessions(engines) -> tuple[int, int]:
    return tuple(engine.stats()["active_sessions"] for engine in engines)


async def test_clients_that_never_read_do_not_keep_a_well_behaved_one_waiting(engines) -> None:
    before = _sessions(engines)
    async with serving(engines, max_active_requests=NON_READERS, queue_timeout_s=2 * WAIT_S,
                       stream_idle_timeout_s=0) as (orchestrator, address), \
            grpc.aio.insecure_channel(address, options=SMALL_WINDOW) as slow, \
            grpc.aio.insecure_channel(address) as fast:
        stub = generation_pb2_grpc.GenerationServiceStub(slow)
        good = generation_pb2_grpc.GenerationServiceStub(fast)

        async def well_behaved() -> float:
            began = time.perf_counter()
            result = await good.Generate(_request(seed=9, n=32), timeout=2 * WAIT_S)
            assert len(result.token_ids) == 32
            return time.perf_counter() - began

        alone = await well_behaved()
        calls = [stub.GenerateStream(_request(seed=i, n=LONG)) for i in range(NON_READERS)]  # never read
        try:
            await _wait_until(lambda: orchestrator.admission_stats()["paused"] == NON_READERS,
                              "every unread stream paused without its slot")
            assert orchestrator.admission_stats()["active"] == 0
            busy = await well_behaved()
            assert busy < 2 * alone + 1.0, (busy, alone)  # delayed by at most one request's time
        finally:
            for call in calls:
                call.cancel()
        await _wait_until(lambda: orchestrator.admission_stats()["paused"] == 0
                          and _sessions(engines) == before, "cancelled streams freed")


async def test_an_unread_stream_is_closed_and_resumes_exactly(engines) -> None:
    before = _sessions(engines)
    async with serving(engines, stream_idle_timeout_s=1.0) as (orchestrator, address), \
            grpc.aio.insecure_channel(address, options=SMALL_WINDOW) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        whole = await stub.Generate(_request(seed=5, n=IDLE_TOKENS, request_id="whole"), timeout=2 * WAIT_S)
        call = stub.GenerateStream(_request(seed=5, n=IDLE_TOKENS, request_id="unread"))
        await _wait_until(lambda: orchestrator.admission_stats()["idle_closed"] == 1, "the unread run closed")
        assert orchestrator.admission_stats()["active"] == 0 and _sessions(engines) == before
        record = await orchestrator.store.get_request("unread")
        assert record.status == "running" and record.lease_until == 0.0
        received: list[int] = []
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            async with asyncio.timeout(WAIT_S):
                async for chunk in call:  # what was sent before the close, then the status
                    received += chunk.token_ids
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "took nothing for 1 s" in caught.value.details()
        assert received == list(whole.token_ids[:len(received)])
        resumed = await stub.Resume(generation_pb2.ResumeRequest(request_id="unread"), timeout=2 * WAIT_S)
        assert list(resumed.token_ids) == list(whole.token_ids)


async def test_a_caller_over_its_cap_is_resource_exhausted(engines) -> None:
    async with serving(engines, max_requests_per_caller=1, stream_idle_timeout_s=0) as (_, address), \
            grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        held = stub.GenerateStream(_request(seed=1, n=LONG))
        try:
            await asyncio.wait_for(anext(held.__aiter__()), WAIT_S)
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.Generate(_request(seed=2, n=4), timeout=WAIT_S)
            assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "127.0.0.1 already has 1 requests open" in caught.value.details()
        finally:
            held.cancel()

"""A hung Redis (SIGSTOP / SIGCONT) and a restarted one, over gRPC: AsyncClient → orchestrator server →
drafter and verifier servers on tiny real models, the orchestrator's store in a real redis-server.

During a hang a new request is UNAVAILABLE within the store timeout, naming the store only; a stream
in flight generates on and, once Redis is back, finishes with every token of the undisturbed run and
its record saved; a stream whose outage outlasts the grace ends UNAVAILABLE and Resume continues it
exactly; after kill -9 and a restart on the same port the next requests succeed (stale pooled
connections are retried once). docs/reliability.md "When Redis hangs".
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402

from drafter_service.server import start_drafter_server  # noqa: E402
from orchestrator.clients.grpc_client import GrpcDrafterClient, GrpcVerifierClient  # noqa: E402
from orchestrator.config import OrchestratorConfig  # noqa: E402
from orchestrator.server import start_orchestrator_server  # noqa: E402
from orchestrator.speculation import Orchestrator  # noqa: E402
from orchestrator.store import STORE_DOWN  # noqa: E402
from specdec.client import AsyncClient  # noqa: E402
from specdec.engine.drafter import DrafterEngine  # noqa: E402
from specdec.engine.verifier import VerifierEngine  # noqa: E402
from specdec.errors import PeerUnavailable, StillRunning  # noqa: E402
from specdec.generation import GenerationChunk, GenerationRequest  # noqa: E402
from specdec.rpc.grpc_support import stop_server  # noqa: E402
from specdec.runtime.loading import load_model  # noqa: E402
from specdec.runtime.tiny import save_tiny_model  # noqa: E402
from specdec.sampling import SamplingParams  # noqa: E402
from tests.orchestrator.helpers import slowed_model  # noqa: E402
from tests.redis_server import RedisServer  # noqa: E402
from verifier_service.server import start_verifier_server  # noqa: E402

pytestmark = pytest.mark.timeout(180)

TIMEOUT_S = 0.25  # store_timeout_s here
SLACK_S = 1.0  # a busy 2-core machine, and a gRPC round trip
HANG_S = 1.5
HANG_WAIT_S = 30.0  # the bound of a wait for progress during a hang (never reached unless broken)
N = 60
SAMPLE = SamplingParams(temperature=1.0)


@dataclass
class Engines:
    drafter: DrafterEngine
    verifier: VerifierEngine  # each target pass sleeps a little, so a stream is still running at the hang


@pytest.fixture(scope="module")
def engines(tmp_path_factory) -> Engines:
    root = tmp_path_factory.mktemp("redis-hang")
    target = save_tiny_model(root / "target", vocab_size=6, seed=11)
    draft = save_tiny_model(root / "draft", vocab_size=6, seed=22)
    return Engines(DrafterEngine(load_model(draft, threads=1)), VerifierEngine(slowed_model(target, 0.02)))


@pytest.fixture
def redis(tmp_path):
    server = RedisServer(tmp_path).start()
    yield server
    server.stop()


@dataclass
class Stack:
    orchestrator: Orchestrator
    address: str
    iterations: list[float]  # when each iteration ended (time.monotonic)

    def client(self) -> AsyncClient:
        return AsyncClient(self.address, timeout_s=60)


@asynccontextmanager
async def serving(engines: Engines, redis: RedisServer, **config) -> AsyncIterator[Stack]:
    """The three services on loopback; the orchestrator's store in `redis`, bounded by TIMEOUT_S."""
    drafter_server, drafter_port = await start_drafter_server(engines.drafter)
    verifier_server, verifier_port = await start_verifier_server(engines.verifier)
    settings = OrchestratorConfig(store_url=redis.url, store_timeout_s=TIMEOUT_S, pipeline=False, **config)
    iterations: list[float] = []
    orchestrator = Orchestrator(GrpcDrafterClient(f"127.0.0.1:{drafter_port}"),
                                GrpcVerifierClient(f"127.0.0.1:{verifier_port}"), settings,
                                on_iteration=lambda _: iterations.append(time.monotonic()))
    server, port = await start_orchestrator_server(orchestrator)
    try:
        yield Stack(orchestrator, f"127.0.0.1:{port}", iterations)
    finally:
        await stop_server(server, 1.0)
        await orchestrator.close()
        await stop_server(drafter_server, 1.0)
        await stop_server(verifier_server, 1.0)


def _request(request_id: str, seed: int = 5, n: int = N) -> GenerationRequest:
    return GenerationRequest(prompt_ids=[1, 2, 3], max_new_tokens=n, method="token", k=3, sampling=SAMPLE,
                             seed=seed, stop_token_ids=[], request_id=request_id)


def _names_the_store_only(message: str, redis: RedisServer) -> None:
    assert STORE_DOWN in message and "UNAVAILABLE" in message
    assert f":{redis.port}" not in message and "redis://" not in message


async def test_a_hang_fails_new_requests_fast_and_in_flight_streams_finish(engines, redis):
    async with serving(engines, redis, store_outage_grace_s=30.0) as stack, stack.client() as client:
        reference = await client.generate(_request("reference"))
        stream = client.generate_stream(_request("through"))
        received = list((await stream.__anext__()).token_ids)
        with redis.paused():
            started = time.monotonic()
            with pytest.raises(PeerUnavailable) as info:
                await client.generate(_request("during", n=4))
            assert time.monotonic() - started < TIMEOUT_S + SLACK_S
            _names_the_store_only(str(info.value), redis)
            # HANG_S at least, and until the stream has made 2 iterations in the hang (each waits for a
            # store timeout: a slow machine may need longer than HANG_S for them); bounded
            deadline = started + HANG_WAIT_S
            while time.monotonic() - started < HANG_S or sum(t > started for t in stack.iterations) < 2:
                assert time.monotonic() < deadline, f"the stream stalled (or had ended): " \
                                                    f"{sum(t > started for t in stack.iterations)} " \
                                                    f"iterations in {HANG_WAIT_S:g} s of the hang"
                await asyncio.sleep(0.05)
        chunks: list[GenerationChunk] = [chunk async for chunk in stream]
        received += [t for chunk in chunks for t in chunk.token_ids]
        assert received == reference.token_ids and chunks[-1].result.token_ids == reference.token_ids
        record = await stack.orchestrator.store.get_request("through")
        assert (record.status, record.token_ids) == ("done", reference.token_ids)

        redis.kill()
        redis.start()  # same port, empty: every pooled connection is dead
        results = await asyncio.gather(*(client.generate(_request(f"after-{i}", n=4)) for i in range(3)))
        assert [len(r.token_ids) for r in results] == [4] * 3


async def test_a_hang_past_the_grace_ends_unavailable_and_resume_continues_exactly(engines, redis):
    grace = 1.0
    async with (serving(engines, redis, store_outage_grace_s=grace, resume_lease_seconds=1.0) as stack,
                stack.client() as client):
        reference = await client.generate(_request("reference"))
        stream = client.generate_stream(_request("cut"))
        received = list((await stream.__anext__()).token_ids)
        with redis.paused():
            started = time.monotonic()
            with pytest.raises(PeerUnavailable, match="Resume continues it") as info:
                async for chunk in stream:
                    received += chunk.token_ids
            took = time.monotonic() - started
            assert grace <= took < grace + 2 * TIMEOUT_S + SLACK_S, took
            _names_the_store_only(str(info.value), redis)
        assert 0 < len(received) < N and received == reference.token_ids[: len(received)]

        deadline = time.monotonic() + 15.0
        while True:  # bounded: the cut run's last lease (1 s) runs out
            try:
                chunks = [chunk async for chunk in client.resume_stream("cut")]
                break
            except StillRunning:
                assert time.monotonic() < deadline, "the cut run's record stayed leased"
                await asyncio.sleep(0.1)
        assert chunks[0].token_ids[: len(received)] == received  # the stored tokens hold what was sent
        assert [t for chunk in chunks for t in chunk.token_ids] == reference.token_ids
        assert chunks[-1].result.token_ids == reference.token_ids

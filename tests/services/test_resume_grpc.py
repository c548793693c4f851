"""Resume over gRPC: AsyncClient → orchestrator server → Orchestrator on gRPC clients → drafter and
verifier servers on tiny real models (loopback).

A seeded request whose client went away mid-stream resumes token for token as the uninterrupted run
(token, block, ersd, rd at T = 1, pipelined as served by default); Generate never overwrites a stored
request of its owner (ALREADY_EXISTS); a record is bound to the bearer token that created it (another
token gets NOT_FOUND, worded as for a missing id, and its Generate with that id makes its own record,
so the id's existence is never revealed); a live run is not resumed twice (ABORTED); and a Redis outage,
before or during a request, is UNAVAILABLE naming the store, never INTERNAL.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import grpc  # noqa: E402
import pytest  # noqa: E402

from drafter_service.server import start_drafter_server  # noqa: E402
from orchestrator.clients.grpc_client import (  # noqa: E402
    GrpcDrafterClient,
    GrpcVerifierClient,
)
from orchestrator.config import OrchestratorConfig  # noqa: E402
from orchestrator.server import start_orchestrator_server  # noqa: E402
from orchestrator.speculation import Orchestrator  # noqa: E402
from orchestrator.store import STORE_DOWN, RedisStore, Store  # noqa: E402
from specdec.client import AsyncClient  # noqa: E402
from specdec.engine.drafter import DrafterEngine  # noqa: E402
from specdec.engine.verifier import VerifierEngine  # noqa: E402
from specdec.errors import AlreadyExists, InvalidRequest, NotFound, PeerUnavailable, StillRunning
from specdec.generation import GenerationChunk, GenerationRequest  # noqa: E402
from specdec.rpc import (
    generation_convert,
)
from specdec.rpc.grpc_support import stop_server  # noqa: E402
from specdec.rpc.security import ANONYMOUS, ClientSecurity, digest  # noqa: E402
from specdec.rpc.v1 import generation_pb2, generation_pb2_grpc  # noqa: E402
from specdec.runtime.loading import load_model  # noqa: E402
from specdec.runtime.tiny import save_tiny_model  # noqa: E402
from specdec.sampling import SamplingParams  # noqa: E402
from tests.orchestrator.helpers import slowed_model  # noqa: E402
from tests.redis_server import RedisServer  # noqa: E402
from verifier_service.server import start_verifier_server  # noqa: E402

pytestmark = pytest.mark.timeout(180)

VOCAB = 6
SAMPLE = SamplingParams(temperature=1.0)
N = 40
RELEASE_WAIT_S = 5.0  # well under the 10 s lease: a closed stream must hand its lease back itself
METHODS = [("token", {"k": 3}), ("block", {"k": 4}), ("ersd", {"k": 3}), ("rd", {"k": 3, "a": 0.5})]
ALICE, BOB = ClientSecurity(token="alice-secret"), ClientSecurity(token="bob-secret")
ALICE_ID, BOB_ID = f"token:{digest('alice-secret')}", f"token:{digest('bob-secret')}"  # their owners


@dataclass
class Engines:
    drafter: DrafterEngine
    verifier: VerifierEngine  # each target pass sleeps a little, so a request runs long enough to cut


@pytest.fixture(scope="module")
def engines(tmp_path_factory) -> Engines:
    root = tmp_path_factory.mktemp("resume-grpc")
    target = save_tiny_model(root / "target", vocab_size=VOCAB, seed=11)
    draft = save_tiny_model(root / "draft", vocab_size=VOCAB, seed=22)
    return Engines(DrafterEngine(load_model(draft, threads=1)), VerifierEngine(slowed_model(target, 0.01)))


@dataclass
class Stack:
    orchestrator: Orchestrator
    address: str

    def client(self, security: ClientSecurity | None = None) -> AsyncClient:
        return AsyncClient(self.address, timeout_s=60, security=security)


# A drafter call past its deadline falls back to a target-only step, another path with other draws: the
# reference and the resumed run compared here must take the same one, so a busy machine (the first
# test of a CI worker once ran its first drafter call past 1 s) must not trip the 1 s default.
DRAFTER_TIMEOUT_FLOOR_S = 30.0


@asynccontextmanager
async def serving(engines: Engines, store: Store | None = None, **config) -> AsyncIterator[Stack]:
    """The three services on loopback, the orchestrator with its default (pipelined) settings but
    `config`'s and a drafter deadline no busy machine reaches."""
    config.setdefault("drafter_timeout_floor_s", DRAFTER_TIMEOUT_FLOOR_S)
    drafter_server, drafter_port = await start_drafter_server(engines.drafter)
    verifier_server, verifier_port = await start_verifier_server(engines.verifier)
    orchestrator = Orchestrator(GrpcDrafterClient(f"127.0.0.1:{drafter_port}"),
                                GrpcVerifierClient(f"127.0.0.1:{verifier_port}"),
                                OrchestratorConfig(**config), store=store)
    server, port = await start_orchestrator_server(orchestrator)
    try:
        yield Stack(orchestrator, f"127.0.0.1:{port}")
    finally:
        await stop_server(server, 1.0)
        await orchestrator.close()
        await stop_server(drafter_server, 1.0)
        await stop_server(verifier_server, 1.0)


def _request(request_id: str, method: str = "token", knobs: dict | None = None, seed: int = 5,
             n: int = N) -> GenerationRequest:
    return GenerationRequest(prompt_ids=[1, 2, 3], max_new_tokens=n, method=method, sampling=SAMPLE,
                             seed=seed, stop_token_ids=[], request_id=request_id, **(knobs or {}))


async def _cut(client: AsyncClient, request: GenerationRequest, chunks: int = 2) -> list[int]:
    """Stream `chunks` chunks, then go away (the call is cancelled); the tokens received."""
    stream = client.generate_stream(request)
    received: list[int] = []
    for _ in range(chunks):
        received += (await stream.__anext__()).token_ids
    await stream.aclose()
    return received


async def _released(stack: Stack, request_id: str, owner: str = ANONYMOUS) -> None:
    """Wait (bounded) until the cut run has stopped and handed its lease back."""
    deadline = time.monotonic() + RELEASE_WAIT_S
    while True:
        record = await stack.orchestrator.store.get_request(request_id, owner)
        if record.lease_until == 0.0:
            return
        assert time.monotonic() < deadline, f"the run of {request_id} kept its lease after its client left"
        await asyncio.sleep(0.02)


@pytest.mark.parametrize("method,knobs", METHODS, ids=[m for m, _ in METHODS])
async def test_resume_continues_a_cut_request_exactly(engines, method, knobs):
    async with serving(engines) as stack, stack.client() as client:
        reference = await client.generate(_request("ref", method, knobs))
        assert len(reference.token_ids) == N and reference.stats.drafted_tokens > 0
        received = await _cut(client, _request("cut", method, knobs))
        await _released(stack, "cut")
        stored = await stack.orchestrator.store.get_request("cut")
        assert stored.status == "running" and stored.token_ids[: len(received)] == received
        assert len(stored.token_ids) < N  # it is a continuation, not a finished request read back

        chunks: list[GenerationChunk] = [chunk async for chunk in client.resume_stream("cut")]
        assert chunks[0].token_ids == stored.token_ids and chunks[0].result is None
        assert [t for chunk in chunks for t in chunk.token_ids] == reference.token_ids
        result = chunks[-1].result
        assert (result.request_id, result.token_ids, result.text) == ("cut", reference.token_ids,
                                                                        reference.text)
        again = await client.resume("cut")  # finished: the stored result
        assert again.token_ids == reference.token_ids and again.finish_reason == "length"


async def test_generate_with_a_stored_id_is_already_exists_and_changes_nothing(engines):
    async with serving(engines) as stack, stack.client() as client:
        first = await client.generate(_request("x", n=10))
        before = (await stack.orchestrator.store.get_request("x")).to_json()
        with pytest.raises(AlreadyExists, match="request_id 'x' already exists; Resume continues it"):
            await client.generate(_request("x", seed=6, n=30))
        with pytest.raises(AlreadyExists, match="already exists"):
            await _cut(client, _request("x", seed=7), chunks=1)
        assert (await stack.orchestrator.store.get_request("x")).to_json() == before
        assert (await client.resume("x")).token_ids == first.token_ids


async def test_a_record_is_bound_to_the_token_that_created_it(engines):
    async with (serving(engines) as stack, stack.client(ALICE) as alice, stack.client(BOB) as bob,
                stack.client() as anonymous):
        received = await _cut(alice, _request("mine"), chunks=1)
        await _released(stack, "mine", ALICE_ID)
        before = (await stack.orchestrator.store.get_request("mine", ALICE_ID)).to_json()
        messages = []
        for client, request_id in ((bob, "mine"), (anonymous, "mine"), (alice, "absent")):
            with pytest.raises(NotFound) as info:
                await client.resume(request_id)
            messages.append(str(info.value).replace(repr(request_id), "ID"))
        with pytest.raises(NotFound):  # the streaming form too
            await bob.resume_stream("mine").__anext__()
        assert len(set(messages)) == 1 and "no stored request ID" in messages[0]  # existence not revealed
        # Bob's Generate with alice's id is neither refused (which would reveal it) nor a write to it:
        # his own request, in his own namespace of ids.
        theirs = await bob.generate(_request("mine", seed=9, n=12))
        assert len(theirs.token_ids) == 12 and theirs.request_id == "mine"
        assert (await stack.orchestrator.store.get_request("mine", ALICE_ID)).to_json() == before
        assert (await stack.orchestrator.store.get_request("mine", BOB_ID)).owner == BOB_ID
        assert "alice-secret" not in before and "bob-secret" not in before  # only a digest is stored
        with pytest.raises(NotFound):  # and the anonymous caller still sees neither
            await anonymous.resume("mine")

        result = await alice.resume("mine")
        assert result.token_ids[: len(received)] == received and len(result.token_ids) == N
        assert (await bob.resume("mine")).token_ids == theirs.token_ids  # each sees its own


async def test_resume_without_an_id_is_invalid_argument(engines):
    with pytest.raises(InvalidRequest, match="request_id"):
        generation_convert.resume_request_to_proto("")
    wire = generation_convert.resume_request_to_proto("r-1")
    assert generation_convert.resume_request_from_proto(wire) == "r-1"
    async with serving(engines) as stack, grpc.aio.insecure_channel(stack.address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        for call in (stub.Resume(generation_pb2.ResumeRequest(), timeout=10),
                     stub.ResumeStream(generation_pb2.ResumeRequest(), timeout=10).read()):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "request_id" in info.value.details()


async def test_a_running_request_is_not_resumed_twice(engines):
    async with serving(engines) as stack, stack.client() as client:
        stream = client.generate_stream(_request("live", n=N))
        received = list((await stream.__anext__()).token_ids)
        with pytest.raises(StillRunning, match="'live' is still running"):
            await client.resume("live")
        received += [t async for chunk in stream for t in chunk.token_ids]
        assert len(received) == N
        assert (await client.resume("live")).token_ids == received  # done: the stored result


async def test_a_redis_outage_is_unavailable_naming_the_store(engines, tmp_path, caplog):
    caplog.set_level(logging.INFO)
    redis_server = RedisServer(tmp_path).start()
    store = RedisStore(redis_server.url, prefix="test-resume-grpc", timeout_seconds=1.0)
    try:  # a short outage grace: a request cut by the outage ends soon (tests/services/test_redis_hang.py)
        async with serving(engines, store, store_outage_grace_s=0.5) as stack, stack.client() as client:
            await client.generate(_request("before", n=4))

            redis_server.kill()
            outage = [client.generate(_request("down-1", n=4)), client.resume("before"),
                      _cut(client, _request("down-2", n=4), chunks=1)]
            for call in outage:
                with pytest.raises(PeerUnavailable) as info:
                    await call
                _names_the_store_only(str(info.value), redis_server)

            redis_server.start()  # same port, empty
            stream = client.generate_stream(_request("cut-by-outage", n=N))
            await stream.__anext__()
            redis_server.kill()  # mid-request
            with pytest.raises(PeerUnavailable) as info:
                async for _ in stream:
                    pass
            _names_the_store_only(str(info.value), redis_server)

            redis_server.start()
            assert len((await client.generate(_request("after", n=4))).token_ids) == 4
        store_log = [r.getMessage() for r in caplog.records if r.name == "orchestrator.store"]
        outages = [line for line in store_log if "unavailable" in line]
        assert len(outages) == 2  # one line per outage, however many calls failed
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR]  # no "internal error" anywhere
    finally:
        redis_server.stop()


def _names_the_store_only(message: str, redis_server: RedisServer) -> None:
    assert STORE_DOWN in message and "UNAVAILABLE" in message
    assert f":{redis_server.port}" not in message and "redis://" not in message

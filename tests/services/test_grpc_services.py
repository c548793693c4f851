"""Real gRPC servers on 127.0.0.1 (port 0) around fake engines: mapping, health, reflection, limits.

Every call has a deadline and every wait is bounded; the whole module runs in a few seconds.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from drafter_service.server import start_drafter_server
from orchestrator.clients.grpc_client import GrpcDrafterClient, GrpcVerifierClient
from orchestrator.server import start_orchestrator_server
from specdec.client import AsyncClient
from specdec.engine.api import DraftRequest, ScoreRequest, VerifyRequest
from specdec.errors import EngineError, InvalidRequest, PeerUnavailable, SessionGone
from specdec.generation import GenerationRequest
from specdec.rpc import convert
from specdec.rpc.grpc_support import stop_server
from specdec.rpc.security import ANONYMOUS
from specdec.rpc.status import RemoteError
from specdec.rpc.v1 import drafter_pb2, drafter_pb2_grpc, verifier_pb2, verifier_pb2_grpc
from specdec.sampling import SamplingParams
from specdec.verification.base import MethodParams
from verifier_service.server import start_verifier_server

from .helpers import SECRET, FakeDrafter, FakeOrchestrator, FakeVerifier

pytestmark = pytest.mark.timeout(60)

SAMPLING = SamplingParams(temperature=0.7, top_k=4, top_p=0.9)


def draft_request(session: str = "s1", **kw) -> DraftRequest:
    fields = dict(
        session_id=session,
        base_len=2,
        append=[3, 4],
        shape_parents=[-1, 0, 1],
        sampling=SAMPLING,
        seed=2**63 + 5,
        strategy="race",
        want_distributions=True,
        include_leaf_rows=True,
    )
    fields.update(kw)
    return DraftRequest(**fields)


def verify_request(session: str = "s1", probs: torch.Tensor | None = None) -> VerifyRequest:
    return VerifyRequest(
        session,
        1,
        [2],
        [3, 4],
        [-1, 0],
        "token",
        MethodParams(a=0.5, k_max=3, seed=9, position=4),
        SAMPLING,
        probs if probs is not None else torch.full((3, 6), 1 / 6),
    )


@pytest.fixture
async def drafter():
    engine = FakeDrafter()
    server, port = await start_drafter_server(engine)
    client = GrpcDrafterClient(f"127.0.0.1:{port}", timeout_s=10)
    try:
        yield engine, client, port
    finally:
        engine.release_event.set()
        await client.close()
        await stop_server(server, 0.5)


@pytest.fixture
async def verifier():
    engine = FakeVerifier()
    server, port = await start_verifier_server(engine)
    client = GrpcVerifierClient(f"127.0.0.1:{port}", timeout_s=10)
    try:
        yield engine, client, port
    finally:
        engine.release_event.set()
        await client.close()
        await stop_server(server, 0.5)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ------------------------------------------------------------------------------ happy paths


async def test_drafter_round_trip(drafter) -> None:
    engine, client, _ = drafter
    info = await client.info()
    assert (info.model_id, info.vocab_size, info.eos_token_ids) == ("fake-draft", 6, (5,))
    request = draft_request()
    result = await client.draft(request)
    seen = engine.calls[-1][1]
    assert seen == request  # the engine got exactly what the client sent (seed > 2**63 included)
    expected = engine.draft(request)
    assert (result.tokens, result.parents, result.reused_tokens) == (expected.tokens, expected.parents, 2)
    assert result.forward_seconds == 0.25
    assert result.draft_probs.dtype == torch.float32 and torch.equal(result.draft_probs, expected.draft_probs)
    no_rows = await client.draft(draft_request(want_distributions=False, shape_parents=[]))
    assert no_rows.draft_probs is None and no_rows.tokens == []
    await client.release("s1")
    assert engine.calls[-1] == ("release", "s1")


async def test_verifier_round_trip(verifier) -> None:
    engine, client, _ = verifier
    assert (await client.info()).model_id == "fake-target"
    score = ScoreRequest("s1", 0, [1, 2], [3], [-1], SAMPLING)
    assert await client.score(score) is None
    assert engine.calls[-1] == ("score", score)
    request = verify_request()
    outcome = await client.verify(request)
    seen = engine.calls[-1][1]
    assert torch.equal(seen.draft_probs, request.draft_probs)
    assert (seen.params, seen.sampling, seen.tree_parents) == (request.params, request.sampling, [-1, 0])
    assert outcome.tokens == [3, 4, 1] and outcome.accept_flags == [True, True]
    assert outcome.committed_len == 5 and (outcome.pass_calls, outcome.pass_rows) == (2, 9)
    assert (outcome.pending_tokens, outcome.score_reused, outcome.text_fallbacks) == (1, True, 3)
    ersd = VerifyRequest("s1", 0, [], [3], [-1], "ersd", MethodParams(seed=1), SAMPLING, None)
    await client.verify(ersd)
    assert engine.calls[-1][1].draft_probs is None
    assert await client.tokenize("t1 t4 t0") == [1, 4, 0]
    assert await client.decode([2, 3]) == "t2 t3"
    await client.release("s1")
    assert engine.calls[-1] == ("release", "s1")


# ----------------------------------------------------------------------------- error mapping

ERROR_CASES = [
    # session id, status code, client exception, text the message must contain
    ("invalid", grpc.StatusCode.INVALID_ARGUMENT, InvalidRequest, "shape_parents"),
    ("context", grpc.StatusCode.INVALID_ARGUMENT, InvalidRequest, "max_context"),
    ("sampling", grpc.StatusCode.INVALID_ARGUMENT, InvalidRequest, "top_p"),
    ("verification", grpc.StatusCode.INVALID_ARGUMENT, InvalidRequest, "draft distributions"),
    ("value", grpc.StatusCode.INVALID_ARGUMENT, InvalidRequest, "tree_tokens"),
    ("gone", grpc.StatusCode.FAILED_PRECONDITION, SessionGone, "resend"),
    ("engine", grpc.StatusCode.INTERNAL, RemoteError, "kv cache"),
    ("crash", grpc.StatusCode.INTERNAL, RemoteError, "internal error"),
]


@pytest.mark.parametrize(
    ("session", "code", "exc_type", "text"), ERROR_CASES, ids=[c[0] for c in ERROR_CASES]
)
async def test_drafter_error_mapping(drafter, session, code, exc_type, text, caplog) -> None:
    engine, client, port = drafter
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = drafter_pb2_grpc.DrafterServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as raw:
            await stub.Draft(convert.draft_request_to_proto(draft_request(session)), timeout=10)
    assert raw.value.code() == code
    assert text in raw.value.details()
    with caplog.at_level(logging.ERROR, logger="specdec.rpc.grpc_support"), pytest.raises(exc_type) as mapped:
        await client.draft(draft_request(session))
    assert text in str(mapped.value)
    if exc_type is RemoteError:
        assert mapped.value.code == code and isinstance(mapped.value, EngineError)
    if session == "crash":  # no internals to the client, the full story in the server log
        assert SECRET not in raw.value.details() and "Traceback" not in raw.value.details()
        assert any(SECRET in str(r.exc_info[1]) for r in caplog.records if r.exc_info)


@pytest.mark.parametrize(
    ("session", "code", "exc_type", "text"),
    ERROR_CASES[::2] + ERROR_CASES[5:6],
    ids=[c[0] for c in ERROR_CASES[::2] + ERROR_CASES[5:6]],
)
async def test_verifier_error_mapping(verifier, session, code, exc_type, text) -> None:
    _, client, _ = verifier
    for call in (
        client.verify(verify_request(session)),
        client.score(ScoreRequest(session, 0, [], [], [], SAMPLING)),
        client.release(session),
    ):
        with pytest.raises(exc_type, match=text):
            await call


async def test_server_side_decode_errors_name_the_field(drafter, verifier) -> None:
    """What a foreign client could send that the Python dataclasses would refuse."""
    _, _, dport = drafter
    _, _, vport = verifier
    async with (
        grpc.aio.insecure_channel(f"127.0.0.1:{dport}") as d,
        grpc.aio.insecure_channel(f"127.0.0.1:{vport}") as v,
    ):
        bad_sampling = drafter_pb2.DraftRequest(session_id="s")
        bad_sampling.sampling.top_p = 2.0
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await drafter_pb2_grpc.DrafterServiceStub(d).Draft(bad_sampling, timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "top_p" in err.value.details()
        bad_tensor = verifier_pb2.VerifyRequest(session_id="s", method="token")
        bad_tensor.draft_probs.shape.extend([3, 6])
        bad_tensor.draft_probs.data_f32 = b"\0" * 10
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await verifier_pb2_grpc.VerifierServiceStub(v).Verify(bad_tensor, timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "draft_probs.data_f32" in err.value.details()


async def test_client_refuses_values_the_wire_cannot_hold(drafter) -> None:
    _, client, _ = drafter
    with pytest.raises(InvalidRequest, match="seed"):
        await client.draft(draft_request(seed=-1))
    with pytest.raises(InvalidRequest):
        await client.draft(draft_request(append=[2**40]))


# ------------------------------------------------------------------------ availability / time


async def test_dead_address_fails_fast_with_the_address() -> None:
    address = f"127.0.0.1:{free_port()}"
    for client in (GrpcDrafterClient(address, timeout_s=30), GrpcVerifierClient(address, timeout_s=30)):
        start = time.monotonic()
        with pytest.raises(PeerUnavailable) as err:
            await client.info()
        assert time.monotonic() - start < 5.0
        assert address in str(err.value)
        assert not await client.is_serving(timeout_s=2)
        await client.close()


async def test_deadline_gives_peer_unavailable_and_loop_stays_free(drafter) -> None:
    engine, _, port = drafter
    client = GrpcDrafterClient(f"127.0.0.1:{port}", timeout_s=0.3)
    start = time.monotonic()
    slow = asyncio.ensure_future(client.draft(draft_request("slow")))
    # The engine call blocks a worker thread, not the server's event loop: health still answers.
    assert await client.is_serving(timeout_s=2)
    with pytest.raises(PeerUnavailable, match="DEADLINE_EXCEEDED") as err:
        await slow
    assert f"127.0.0.1:{port}" in str(err.value)
    assert time.monotonic() - start < 3.0
    engine.release_event.set()
    await client.close()


async def test_message_size_limits_give_resource_exhausted() -> None:
    engine = FakeDrafter(big_rows=300)  # 300 x 1000 float32 = 1.2 MB of rows
    server, port = await start_drafter_server(engine, max_message_mb=0.5)
    address = f"127.0.0.1:{port}"
    try:
        # Response too large for the server's send limit.
        async with GrpcDrafterClient(address, timeout_s=10, max_message_mb=8) as client:
            with pytest.raises(RemoteError) as err:
                await client.draft(draft_request("big"))
            assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_message_mb" in str(err.value)
            # ... and the server is still fine afterwards.
            assert (await client.draft(draft_request("ok"))).tokens == [1, 2, 3]
        # Response too large for the client's receive limit (server allows it).
        server2, port2 = await start_drafter_server(engine, max_message_mb=8)
        try:
            async with GrpcDrafterClient(f"127.0.0.1:{port2}", timeout_s=10, max_message_mb=0.5) as client:
                with pytest.raises(RemoteError) as err:
                    await client.draft(draft_request("big"))
                assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        finally:
            await stop_server(server2, 0.2)
    finally:
        await stop_server(server, 0.2)


async def test_request_larger_than_server_limit() -> None:
    engine = FakeVerifier()
    server, port = await start_verifier_server(engine, max_message_mb=0.5)
    try:
        async with GrpcVerifierClient(f"127.0.0.1:{port}", timeout_s=10, max_message_mb=8) as client:
            with pytest.raises(RemoteError) as err:
                await client.verify(verify_request(probs=torch.rand(300, 1000)))
            assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert not [c for c in engine.calls if c[0] == "verify"]  # never reached the engine
    finally:
        await stop_server(server, 0.2)


# ------------------------------------------------------------------------ health / reflection


async def test_health_serving_and_not_serving_after_stop() -> None:
    server, port = await start_verifier_server(FakeVerifier())
    address = f"127.0.0.1:{port}"
    async with grpc.aio.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for name in ("", "specdec.v1.VerifierService"):
            response = await stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
            assert response.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Check(health_pb2.HealthCheckRequest(service="specdec.v1.Nope"), timeout=5)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
    client = GrpcVerifierClient(address, timeout_s=5)
    assert await client.is_serving()
    await stop_server(server, 0.2)
    assert not await client.is_serving()
    with pytest.raises(PeerUnavailable):
        await client.info()
    await client.close()


async def reflect(address: str, request: reflection_pb2.ServerReflectionRequest):
    async with grpc.aio.insecure_channel(address) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        call = stub.ServerReflectionInfo(iter([request]), timeout=5)
        return [response async for response in call][0]


@pytest.mark.parametrize("kind", ["drafter", "verifier", "orchestrator"])
async def test_reflection_lists_the_services(kind) -> None:
    start = {
        "drafter": (start_drafter_server, FakeDrafter),
        "verifier": (start_verifier_server, FakeVerifier),
        "orchestrator": (start_orchestrator_server, FakeOrchestrator),
    }[kind]
    service = {
        "drafter": "specdec.v1.DrafterService",
        "verifier": "specdec.v1.VerifierService",
        "orchestrator": "specdec.v1.GenerationService",
    }[kind]
    server, port = await start[0](start[1]())
    try:
        address = f"127.0.0.1:{port}"
        listed = await reflect(address, reflection_pb2.ServerReflectionRequest(list_services=""))
        names = {s.name for s in listed.list_services_response.service}
        assert names == {service, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"}
        files = await reflect(address, reflection_pb2.ServerReflectionRequest(file_containing_symbol=service))
        assert (
            files.file_descriptor_response.file_descriptor_proto
        )  # the descriptor is served, imports resolve
    finally:
        await stop_server(server, 0.2)


# ------------------------------------------------------------------------------- interceptors


class RecordingServerInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self) -> None:
        self.seen: list[tuple[str, dict[str, str]]] = []

    async def intercept_service(self, continuation, handler_call_details):
        self.seen.append((handler_call_details.method, dict(handler_call_details.invocation_metadata or ())))
        return await continuation(handler_call_details)


class TraceparentClientInterceptor(grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):
        metadata = grpc.aio.Metadata(*(client_call_details.metadata or ()))
        metadata.add("traceparent", "00-abc-def-01")
        return await continuation(client_call_details._replace(metadata=metadata), request)


async def test_interceptor_hooks_carry_metadata() -> None:
    recorder = RecordingServerInterceptor()
    server, port = await start_drafter_server(FakeDrafter(), interceptors=[recorder])
    try:
        async with GrpcDrafterClient(
            f"127.0.0.1:{port}", interceptors=[TraceparentClientInterceptor()]
        ) as client:
            await client.info()
        method, metadata = recorder.seen[-1]
        assert method == "/specdec.v1.DrafterService/Info" and metadata.get("traceparent") == "00-abc-def-01"
    finally:
        await stop_server(server, 0.2)


# ------------------------------------------------------------------------------ orchestrator


@pytest.fixture
async def orchestrator():
    fake = FakeOrchestrator()
    server, port = await start_orchestrator_server(fake)
    client = AsyncClient(f"127.0.0.1:{port}", timeout_s=10)
    try:
        yield fake, client
    finally:
        await client.close()
        await stop_server(server, 0.5)


async def test_generate_round_trip(orchestrator) -> None:
    fake, client = orchestrator
    request = GenerationRequest(
        prompt_ids=[1, 2, 3],
        max_new_tokens=2,
        sampling=SAMPLING,
        stop=["t5"],
        stop_token_ids=[],
        seed=11,
        method="ersd",
        k=4,
        a=0.5,
        request_id="req-9",
        tree_budget=8,
    )
    result = await client.generate(request)
    assert fake.requests[-1] == request
    assert result == fake._result(request)
    assert result.stats.acceptance_rate == 0.75
    # The door passes who called: an anonymous caller is capped by its address (no port)
    assert fake.owners[-1] == ANONYMOUS and fake.callers[-1] == "peer:ipv4:127.0.0.1"


async def test_generate_stream(orchestrator) -> None:
    fake, client = orchestrator
    request = GenerationRequest(prompt_ids=[4, 0, 2], max_new_tokens=3, seed=3)
    chunks = [chunk async for chunk in client.generate_stream(request)]
    assert [c.token_ids for c in chunks[:-1]] == [[4], [0], [2]] and chunks[-1].result == fake._result(
        request
    )
    assert all(c.result is None for c in chunks[:-1])


@pytest.mark.parametrize(
    ("prompt", "exc_type", "text"),
    [
        ("unavailable", PeerUnavailable, "verifier down"),
        ("invalid", InvalidRequest, "max_new_tokens"),
        ("crash", RemoteError, "internal error"),
    ],
)
async def test_generate_errors(orchestrator, prompt, exc_type, text) -> None:
    _, client = orchestrator
    for stream in (False, True):
        with pytest.raises(exc_type, match=text) as err:
            if stream:
                [chunk async for chunk in client.generate_stream(GenerationRequest(prompt=prompt))]
            else:
                await client.generate(GenerationRequest(prompt=prompt))
        assert SECRET not in str(err.value)


async def test_stream_error_after_chunks(orchestrator) -> None:
    _, client = orchestrator
    got = []
    with pytest.raises(SessionGone, match="twice"):
        async for chunk in client.generate_stream(
            GenerationRequest(prompt="midstream", prompt_ids=[1, 2, 3])
        ):
            got.append(chunk.token_ids)
    assert got == [[1]]


async def test_stream_cancelled_by_client_closes_the_orchestrator_stream(orchestrator) -> None:
    fake, client = orchestrator
    stream = client.generate_stream(GenerationRequest(prompt="endless", prompt_ids=[1]))
    async for _chunk in stream:
        break
    await stream.aclose()
    await asyncio.wait_for(fake.stream_closed.wait(), timeout=5)


async def test_generation_client_dead_address() -> None:
    address = f"127.0.0.1:{free_port()}"
    async with AsyncClient(address) as client:
        with pytest.raises(PeerUnavailable, match=address):
            await client.generate(GenerationRequest(prompt="x"))
        with pytest.raises(PeerUnavailable, match=address):
            [chunk async for chunk in client.generate_stream(GenerationRequest(prompt="x"))]

"""TLS, mTLS and bearer tokens on real loopback gRPC servers: the orchestrator over real engines on
tiny random models (TLS + a client token in front, mTLS + an engine token behind), and fake engines
where only the door matters."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import grpc  # noqa: E402
import pytest  # noqa: E402
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc  # noqa: E402

from drafter_service.server import start_drafter_server  # noqa: E402
from orchestrator.clients.grpc_client import (  # noqa: E402
    GrpcDrafterClient,
    GrpcVerifierClient,
)
from orchestrator.server import start_orchestrator_server  # noqa: E402
from orchestrator.speculation import Orchestrator  # noqa: E402
from specdec.client import AsyncClient  # noqa: E402
from specdec.engine.api import DraftRequest, LookaheadRequest
from specdec.errors import PeerUnavailable, Unauthenticated
from specdec.generation import GenerationRequest  # noqa: E402
from specdec.rpc.grpc_support import stop_server  # noqa: E402
from specdec.rpc.security import UNAUTHENTICATED_MESSAGE, ClientSecurity, ServerSecurity  # noqa: E402
from specdec.sampling import SamplingParams  # noqa: E402
from tests.services.helpers import FakeDrafter, FakeVerifier  # noqa: E402
from verifier_service.server import start_verifier_server  # noqa: E402

from .conftest import ENGINE_TOKEN, TOKEN  # noqa: E402

pytestmark = pytest.mark.timeout(120)

VOCAB = 6
RPC_TIMEOUT_S = 30.0


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    from specdec.engine.drafter import DrafterEngine
    from specdec.engine.verifier import VerifierEngine
    from specdec.runtime.loading import load_model
    from specdec.runtime.tiny import save_tiny_model

    root = tmp_path_factory.mktemp("tls-tiny")
    target = load_model(save_tiny_model(root / "target", vocab_size=VOCAB, seed=11), threads=1)
    draft = load_model(save_tiny_model(root / "draft", vocab_size=VOCAB, seed=22), threads=1)
    return DrafterEngine(draft), VerifierEngine(target)


@dataclass
class Stack:
    orchestrator: str  # addresses
    drafter: str
    verifier: str


def engine_door(pki) -> ServerSecurity:
    """What an engine behind the orchestrator runs with: mTLS required and the engine token."""
    return ServerSecurity(pki.server_cert, pki.server_key, pki.ca, True, (ENGINE_TOKEN,))


def orchestrator_pass(pki) -> ClientSecurity:
    """What the orchestrator presents to its engines: the CA, its client certificate, the engine token."""
    return ClientSecurity(pki.ca, pki.client_cert, pki.client_key, token=ENGINE_TOKEN)


@contextlib.asynccontextmanager
async def secured_stack(pki, engines) -> AsyncIterator[Stack]:
    drafter_engine, verifier_engine = engines
    door = engine_door(pki)
    servers = []
    orchestrator = None
    try:
        drafter, d_port = await start_drafter_server(drafter_engine, credentials=door.credentials,
                                                     interceptors=door.interceptors())
        servers.append(drafter)
        verifier, v_port = await start_verifier_server(verifier_engine, credentials=door.credentials,
                                                       interceptors=door.interceptors())
        servers.append(verifier)
        d_address, v_address = f"localhost:{d_port}", f"localhost:{v_port}"
        orchestrator = Orchestrator(GrpcDrafterClient(d_address, security=orchestrator_pass(pki)),
                                    GrpcVerifierClient(v_address, security=orchestrator_pass(pki)))
        await orchestrator.start()
        front = ServerSecurity(pki.server_cert, pki.server_key, tokens=(TOKEN,))
        server, o_port = await start_orchestrator_server(orchestrator, credentials=front.credentials,
                                                         interceptors=front.interceptors())
        servers.append(server)
        yield Stack(f"localhost:{o_port}", d_address, v_address)
    finally:
        for server in reversed(servers):
            await stop_server(server, 0.5)
        if orchestrator is not None:
            await orchestrator.close()


REQUEST = GenerationRequest(prompt_ids=[1, 2, 3], max_new_tokens=6, seed=3, method="token", k=2,
                            stop_token_ids=[], sampling=SamplingParams(temperature=1.0))


def generation_client(address: str, **security) -> AsyncClient:
    return AsyncClient(address, timeout_s=RPC_TIMEOUT_S, security=ClientSecurity(**security))


async def health(address: str, security: ClientSecurity) -> str:
    async with security.channel(address) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


# ------------------------------------------------------------------------------ the orchestrator's door


async def test_tls_and_token_in_front_mtls_and_token_behind(pki, engines, caplog) -> None:
    """The whole path: a plaintext client is refused; a TLS client needs the token; with it, tokens."""
    caplog.set_level(logging.DEBUG)
    async with secured_stack(pki, engines) as stack:
        async with generation_client(stack.orchestrator, token=TOKEN) as plaintext:
            with pytest.raises(PeerUnavailable):  # TLS server, plaintext client: no handshake
                await plaintext.generate(REQUEST)
        for token in (None, "wrong-token-value-42"):
            async with generation_client(stack.orchestrator, tls_ca=pki.ca, token=token) as client:
                with pytest.raises(Unauthenticated, match=UNAUTHENTICATED_MESSAGE) as raised:
                    await client.generate(REQUEST)
                assert TOKEN not in str(raised.value) and "wrong-token" not in str(raised.value)
                with pytest.raises(Unauthenticated):
                    async for _ in client.generate_stream(REQUEST):
                        pass
        async with generation_client(stack.orchestrator, tls_ca=pki.ca, token=TOKEN) as client:
            result = await client.generate(REQUEST)
            chunks = [chunk async for chunk in client.generate_stream(REQUEST)]
        assert len(result.token_ids) == REQUEST.max_new_tokens
        assert [t for chunk in chunks for t in chunk.token_ids] == result.token_ids  # same seed
        assert result.stats.drafted_tokens > 0  # the drafter answered through its mTLS door
        # Health stays open for probes (no token), over TLS.
        assert await health(stack.orchestrator, ClientSecurity(tls_ca=pki.ca)) == "SERVING"
    logged = caplog.text
    assert "refused" in logged and "bearer token" in logged  # rejections are logged ...
    for secret in (TOKEN, ENGINE_TOKEN, "wrong-token-value-42"):
        assert secret not in logged  # ... but never a token


# ------------------------------------------------------------------------------ the engines' door


async def test_mtls_engine_refuses_clients_without_a_certificate_of_its_ca(pki, engines) -> None:
    async with secured_stack(pki, engines) as stack:
        for security in (
            ClientSecurity(token=ENGINE_TOKEN),  # plaintext
            ClientSecurity(pki.ca, token=ENGINE_TOKEN),  # TLS, no client certificate
            ClientSecurity(pki.ca, pki.stranger_cert, pki.stranger_key, token=ENGINE_TOKEN),  # other CA
        ):
            async with GrpcDrafterClient(stack.drafter, timeout_s=RPC_TIMEOUT_S, security=security) as client:
                with pytest.raises(PeerUnavailable):
                    await client.info()
                assert not await client.is_serving()
        # The orchestrator's certificate and token open it.
        async with GrpcDrafterClient(stack.drafter, security=orchestrator_pass(pki)) as client:
            assert (await client.info()).vocab_size == VOCAB
            assert await client.is_serving()


async def test_engine_with_mtls_still_needs_its_token(pki, engines) -> None:
    """A valid client certificate alone is not enough when the engine also has a token."""
    async with secured_stack(pki, engines) as stack:
        cert_only = ClientSecurity(pki.ca, pki.client_cert, pki.client_key)
        async with GrpcVerifierClient(stack.verifier, timeout_s=RPC_TIMEOUT_S, security=cert_only) as client:
            with pytest.raises(Unauthenticated):
                await client.tokenize("t1 t2")
            assert await client.is_serving()  # health: no token needed
        assert await health(stack.verifier, cert_only) == "SERVING"


@contextlib.asynccontextmanager
async def token_engines() -> AsyncIterator[tuple[FakeDrafter, FakeVerifier, str, str]]:
    """Fake engines on plaintext loopback with the engine token (only the door matters here)."""
    door = ServerSecurity(tokens=(ENGINE_TOKEN,))
    drafter_engine, verifier_engine = FakeDrafter(), FakeVerifier()
    drafter, d_port = await start_drafter_server(drafter_engine, interceptors=door.interceptors())
    verifier, v_port = await start_verifier_server(verifier_engine, interceptors=door.interceptors())
    try:
        yield drafter_engine, verifier_engine, f"127.0.0.1:{d_port}", f"127.0.0.1:{v_port}"
    finally:
        await stop_server(drafter, 0.2)
        await stop_server(verifier, 0.2)


@pytest.mark.parametrize("token", [None, "not-the-engine-token"], ids=["no-token", "wrong-token"])
async def test_engine_token_refuses_every_engine_rpc_but_health(token, caplog) -> None:
    caplog.set_level(logging.DEBUG)
    security = ClientSecurity(token=token)
    async with token_engines() as (drafter_engine, verifier_engine, d_address, v_address):
        async with GrpcDrafterClient(d_address, timeout_s=10, security=security) as drafter, \
                GrpcVerifierClient(v_address, timeout_s=10, security=security) as verifier:
            calls = {
                "Draft": drafter.draft(DraftRequest("s1", 0, [1, 2], [-1, 0], SamplingParams(), 7)),
                "Lookahead": drafter.lookahead(LookaheadRequest(
                    "s1", 0, [1, 2], 1000, SamplingParams(), 7, bonus_guesses=16, rejection_guesses=16)),
                "Release (drafter)": drafter.release("someone-elses-session"),
                "Release (verifier)": verifier.release("someone-elses-session"),
                "Tokenize": verifier.tokenize("t1 t2"),
                "Info": verifier.info(),
            }
            refused = []
            for name, call in calls.items():
                with contextlib.suppress(Unauthenticated):
                    await call
                    continue
                refused.append(name)
            assert refused == list(calls)
            assert await drafter.is_serving() and await verifier.is_serving()
        async with GrpcDrafterClient(d_address, security=ClientSecurity(token=ENGINE_TOKEN)) as allowed:
            assert (await allowed.info()).vocab_size == 6
            await allowed.release("mine")
    assert drafter_engine.calls == [("release", "mine")] and verifier_engine.calls == []  # nothing got in
    assert ENGINE_TOKEN not in caplog.text and "not-the-engine-token" not in caplog.text


async def test_reflection_needs_the_token_too() -> None:
    async with token_engines() as (_, _, d_address, _):
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        for security, expected in ((ClientSecurity(), grpc.StatusCode.UNAUTHENTICATED),
                                   (ClientSecurity(token=ENGINE_TOKEN), None)):
            async with security.channel(d_address) as channel:
                if expected is None:
                    call = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
                        iter([request]), timeout=10)
                    replies = [reply async for reply in call]
                    assert replies[0].list_services_response.service
                else:
                    assert await _refused_stream_code(channel, request) == expected


async def _refused_stream_code(channel: grpc.aio.Channel,
                               request: reflection_pb2.ServerReflectionRequest) -> grpc.StatusCode:
    """The status a reflection stream without the token ends with. It never yields a reply. The
    client may lose the race of sending its request against the server's refusal, and then reports
    INTERNAL ("Failed execute_batch") from its own side; the server's answer is read on another try."""
    for _ in range(5):
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            _ = [reply async for reply in stub.ServerReflectionInfo(iter([request]), timeout=10)]
        error = raised.value
        said = f"{error.details()} {error.debug_error_string()}"
        if not (error.code() == grpc.StatusCode.INTERNAL and "execute_batch" in said):
            return error.code()
    return error.code()


async def test_an_unknown_method_stays_unimplemented() -> None:
    async with token_engines() as (_, _, d_address, _):
        async with grpc.aio.insecure_channel(d_address) as channel:
            call = channel.unary_unary("/specdec.v1.DrafterService/NoSuchMethod")
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await call(b"", timeout=10)
        assert raised.value.code() == grpc.StatusCode.UNIMPLEMENTED

"""Client and AsyncClient against a real orchestrator on loopback (tiny random models behind the in-process
transport): the same greedy output from both, streams that add up to the result, resume, the errors a
caller catches, a token-protected and a TLS server; and the request builder on its own."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402

from orchestrator.clients.inprocess import InProcessDrafterClient, InProcessVerifierClient  # noqa: E402
from orchestrator.server import start_orchestrator_server  # noqa: E402
from orchestrator.speculation import Orchestrator  # noqa: E402
from specdec.client import (  # noqa: E402
    AsyncClient,
    ChatMessage,
    Client,
    GenerationRequest,
    InvalidRequest,
    NotFound,
    PeerUnavailable,
    SamplingParams,
    Unauthenticated,
    build_request,
)
from specdec.rpc.grpc_support import stop_server  # noqa: E402
from specdec.rpc.security import ClientSecurity, ServerSecurity  # noqa: E402
from tests.redis_server import free_port  # noqa: E402

pytestmark = pytest.mark.timeout(120)

TOKEN = "client-test-token-0123456789"
RPC_TIMEOUT_S = 60.0
PROMPT = "t1 t2 t3"
GREEDY = {"max_new_tokens": 8, "temperature": 0, "stop_token_ids": [], "method": "token", "k": 2}


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    from specdec.engine.drafter import DrafterEngine
    from specdec.engine.verifier import VerifierEngine
    from specdec.runtime.loading import load_model
    from specdec.runtime.tiny import save_tiny_model

    root = tmp_path_factory.mktemp("client-tiny")
    target = load_model(save_tiny_model(root / "target", vocab_size=8, seed=2), threads=1)
    draft = load_model(save_tiny_model(root / "draft", vocab_size=8, seed=1), threads=1)
    return DrafterEngine(draft), VerifierEngine(target)


@contextlib.asynccontextmanager
async def serving(engines, security: ServerSecurity | None = None) -> AsyncIterator[str]:
    """An orchestrator server on loopback over the tiny engines; yields its address."""
    drafter, verifier = engines
    orchestrator = Orchestrator(InProcessDrafterClient(drafter), InProcessVerifierClient(verifier))
    await orchestrator.start()
    server = None
    try:
        security = security or ServerSecurity()
        server, port = await start_orchestrator_server(orchestrator, credentials=security.credentials,
                                                       interceptors=security.interceptors())
        address = f"localhost:{port}"
        if not security.tls:  # health needs no token; over TLS the tests wait themselves
            async with AsyncClient(address) as probe:
                for _ in range(200):  # bounded: the health monitor's first round sets SERVING
                    if await probe.health() == "SERVING":
                        break
                    await asyncio.sleep(0.02)
        yield address
    finally:
        if server is not None:
            await stop_server(server, 0.5)
        await orchestrator.close()


def _stream_sync(client: Client, *args, **fields) -> list:
    return list(client.generate_stream(*args, **fields))


# ------------------------------------------------------------------------------ generation


async def test_client_and_async_client_agree_and_streams_add_up(engines) -> None:
    async with serving(engines) as address:
        async with AsyncClient(address, timeout_s=RPC_TIMEOUT_S) as aclient:
            assert await aclient.health() == "SERVING"
            result = await aclient.generate(PROMPT, **GREEDY)
            chunks = [chunk async for chunk in aclient.generate_stream(PROMPT, **GREEDY)]
        with Client(address, timeout_s=RPC_TIMEOUT_S) as client:
            assert await asyncio.to_thread(client.health) == "SERVING"
            sync_result = await asyncio.to_thread(client.generate, GenerationRequest(
                prompt=PROMPT, max_new_tokens=8, sampling=SamplingParams(temperature=0), stop_token_ids=[],
                method="token", k=2))
            sync_chunks = await asyncio.to_thread(_stream_sync, client, PROMPT, **GREEDY)
    assert len(result.token_ids) == 8 and result.finish_reason == "length" and result.prompt_tokens == 3
    assert (sync_result.token_ids, sync_result.text) == (result.token_ids, result.text)  # greedy: one answer
    for pieces in (chunks, sync_chunks):
        assert "".join(chunk.text for chunk in pieces) == result.text
        assert [t for chunk in pieces for t in chunk.token_ids] == result.token_ids
        assert pieces[-1].result is not None and pieces[-1].result.token_ids == result.token_ids
        assert all(chunk.result is None for chunk in pieces[:-1])


async def test_resume_of_a_finished_request_answers_its_result(engines) -> None:
    async with serving(engines) as address:
        async with AsyncClient(address, timeout_s=RPC_TIMEOUT_S) as aclient:
            first = await aclient.generate(PROMPT, request_id="req-resume", seed=5, max_new_tokens=6,
                                           stop_token_ids=[])
            again = await aclient.resume("req-resume")
            streamed = [chunk async for chunk in aclient.resume_stream("req-resume")]
            with pytest.raises(NotFound):
                await aclient.resume("no-such-request")
        with Client(address, timeout_s=RPC_TIMEOUT_S) as client:
            sync_again = await asyncio.to_thread(client.resume, "req-resume")
            with pytest.raises(NotFound):
                await asyncio.to_thread(client.resume, "no-such-request")
    assert first.request_id == "req-resume" and len(first.token_ids) == 6
    assert again.token_ids == sync_again.token_ids == first.token_ids
    assert [t for chunk in streamed for t in chunk.token_ids] == first.token_ids


async def test_a_bad_request_raises_invalid_request(engines) -> None:
    async with serving(engines) as address:
        async with AsyncClient(address, timeout_s=RPC_TIMEOUT_S) as aclient:
            with pytest.raises(InvalidRequest, match="method"):
                await aclient.generate(PROMPT, method="no-such-method")
            with pytest.raises(InvalidRequest, match="method"):
                [chunk async for chunk in aclient.generate_stream(PROMPT, method="no-such-method")]
        with Client(address, timeout_s=RPC_TIMEOUT_S) as client:
            with pytest.raises(InvalidRequest, match="method"):
                await asyncio.to_thread(client.generate, PROMPT, method="no-such-method")
            with pytest.raises(InvalidRequest, match="method"):
                await asyncio.to_thread(_stream_sync, client, PROMPT, method="no-such-method")
            with pytest.raises(InvalidRequest, match="request_id"):  # checked here, never sent
                client.resume("")
    with Client(address) as client:  # out of range before any call: nothing listens there any more
        with pytest.raises(InvalidRequest, match="temperature"):
            client.generate(PROMPT, temperature=-1)


async def test_a_token_protected_orchestrator(engines) -> None:
    async with serving(engines, ServerSecurity(tokens=(TOKEN,))) as address:
        async with AsyncClient(address, timeout_s=RPC_TIMEOUT_S) as anonymous:
            assert await anonymous.health() == "SERVING"  # health is open for probes
            with pytest.raises(Unauthenticated):
                await anonymous.generate(PROMPT, max_new_tokens=2)
        async with AsyncClient(address, timeout_s=RPC_TIMEOUT_S, token="wrong-token") as wrong:
            with pytest.raises(Unauthenticated) as raised:
                [chunk async for chunk in wrong.generate_stream(PROMPT, max_new_tokens=2)]
            assert "wrong-token" not in str(raised.value)
        async with AsyncClient(address, timeout_s=RPC_TIMEOUT_S, token=TOKEN) as aclient:
            result = await aclient.generate(PROMPT, **GREEDY)
        with Client(address, timeout_s=RPC_TIMEOUT_S) as anonymous_sync:
            with pytest.raises(Unauthenticated):
                await asyncio.to_thread(anonymous_sync.generate, PROMPT, max_new_tokens=2)
        with Client(address, timeout_s=RPC_TIMEOUT_S, token=TOKEN) as client:
            sync_result = await asyncio.to_thread(client.generate, PROMPT, **GREEDY)
            sync_chunks = await asyncio.to_thread(_stream_sync, client, PROMPT, **GREEDY)
    assert sync_result.token_ids == result.token_ids and len(result.token_ids) == 8
    assert [t for chunk in sync_chunks for t in chunk.token_ids] == result.token_ids


async def test_tls_and_token_keywords(engines, tmp_path) -> None:
    from tests.security import pki as pki_module

    if not pki_module.available():
        pytest.skip("needs the cryptography package or the openssl command to make certificates")
    pki = pki_module.make_pki(tmp_path / "pki")
    door = ServerSecurity(pki.server_cert, pki.server_key, tokens=(TOKEN,))
    async with serving(engines, door) as address:
        with Client(address, timeout_s=RPC_TIMEOUT_S, token=TOKEN) as plaintext:
            with pytest.raises(PeerUnavailable):  # a TLS server, a plaintext client: no handshake
                await asyncio.to_thread(plaintext.generate, PROMPT, max_new_tokens=2)
        with Client(address, timeout_s=RPC_TIMEOUT_S, tls_ca=str(pki.ca), token=TOKEN) as client:
            sync_result = await asyncio.to_thread(client.generate, PROMPT, **GREEDY)
        async with AsyncClient(address, timeout_s=RPC_TIMEOUT_S,
                               security=ClientSecurity(tls_ca=pki.ca, token=TOKEN)) as aclient:
            result = await aclient.generate(PROMPT, **GREEDY)
    assert sync_result.token_ids == result.token_ids and len(result.token_ids) == 8


async def test_nothing_listening_is_peer_unavailable() -> None:
    address = f"127.0.0.1:{free_port()}"
    with Client(address, timeout_s=5) as client:
        with pytest.raises(PeerUnavailable, match=address):
            client.generate(PROMPT)
        with pytest.raises(PeerUnavailable):
            client.health()
        assert client.is_serving() is False
    async with AsyncClient(address, timeout_s=5) as aclient:
        with pytest.raises(PeerUnavailable, match=address):
            await aclient.generate(PROMPT)
        assert await aclient.is_serving() is False


# ------------------------------------------------------------------------------ requests


def test_build_request_from_a_prompt_and_keywords() -> None:
    request = build_request("def f", max_new_tokens=32, temperature=0, top_k=5, seed=3, stop=["\n\n"])
    assert request == GenerationRequest(prompt="def f", max_new_tokens=32, seed=3, stop=["\n\n"],
                                        sampling=SamplingParams(temperature=0, top_k=5))
    # knobs not given stay None: the orchestrator's defaults (--default-method, --default-k, …) apply
    assert (request.method, request.k, request.a, request.pipeline) == (None, None, None, None)
    base = GenerationRequest(prompt_ids=[1, 2], sampling=SamplingParams(temperature=0.5, top_p=0.9))
    changed = build_request(base, top_k=4, seed=9)
    assert changed.sampling == SamplingParams(temperature=0.5, top_k=4, top_p=0.9) and changed.seed == 9
    assert base.seed is None and base.sampling.top_k == 0  # the given request is left as it was
    assert build_request(base) == base


def test_build_request_takes_chat_messages_as_mappings() -> None:
    request = build_request(messages=[{"role": "system", "content": "Be brief."},
                                      ChatMessage("user", "Hi")], max_new_tokens=4)
    assert request.prompt is None
    assert request.messages == [ChatMessage("system", "Be brief."), ChatMessage("user", "Hi")]
    with pytest.raises(InvalidRequest, match=r"messages\[0\]\.role"):
        build_request(messages=[{"role": "robot", "content": "x"}])
    with pytest.raises(InvalidRequest, match=r"messages\[1\]\.content"):
        build_request(messages=[{"role": "user", "content": "x"}, {"role": "user", "content": 3}])
    with pytest.raises(InvalidRequest, match=r"messages\[0\]: unknown key"):
        build_request(messages=[{"role": "user", "content": "x", "name": "bob"}])
    with pytest.raises(InvalidRequest, match="list"):
        build_request(messages="hello")


def test_build_request_refuses_what_no_request_has() -> None:
    with pytest.raises(TypeError, match="max_tokens"):
        build_request("x", max_tokens=3)
    with pytest.raises(TypeError, match="not both"):
        build_request("x", sampling=SamplingParams(), temperature=0)
    with pytest.raises(TypeError, match="once"):
        build_request("x", prompt="y")
    with pytest.raises(TypeError, match="prompt"):
        build_request(42)
    with pytest.raises(InvalidRequest, match="top_p"):
        build_request("x", top_p=0)


def test_security_keywords_or_a_security_object_not_both(tmp_path) -> None:
    with pytest.raises(ValueError, match="not both"):
        Client("127.0.0.1:1", token=TOKEN, security=ClientSecurity(token=TOKEN))
    with pytest.raises(ValueError, match="--tls-ca"):
        Client("127.0.0.1:1", tls_ca=tmp_path / "missing.pem")
    with pytest.raises(ValueError, match="timeout_s"):
        AsyncClient("127.0.0.1:1", timeout_s=0)
    assert TOKEN not in repr(Client("127.0.0.1:1", token=TOKEN))

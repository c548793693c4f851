"""Issue 14 through the orchestrator's gRPC front door, on tiny real engines behind gRPC: oversized
requests fail fast with INVALID_ARGUMENT naming the field and the limit, before any work (the
verifier never sees an oversized prompt); parameters a method ignores, or a temperature below the
bound, are refused; a lost verifier's address stays in the server log, out of the client's message."""

from __future__ import annotations

import logging
import socket
import time
from typing import Any

import grpc
import pytest
from pydantic import ValidationError

from drafter_service.server import start_drafter_server
from orchestrator.clients.grpc_client import GrpcDrafterClient, GrpcVerifierClient
from orchestrator.config import OrchestratorConfig
from orchestrator.server import start_orchestrator_server
from orchestrator.speculation import Orchestrator
from specdec.engine.api import MAX_LOOKAHEAD_K, MAX_TREE_NODES
from specdec.rpc.grpc_support import stop_server
from specdec.rpc.v1 import common_pb2, generation_pb2
from verifier_service.server import start_verifier_server

pytestmark = pytest.mark.timeout(180)

GENERATE = "/specdec.v1.GenerationService/Generate"
FAST_S = 5.0  # generous on a busy 2-core machine: the large cases are mostly bytes on the wire
MB = 2**20


class Stack:
    """Drafter and verifier servers on the session's engines, an orchestrator on gRPC clients to
    them, and its GenerationService; `tokenized` lists the texts the verifier engine was given."""

    def __init__(self, engines: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
        self.engines = engines
        self.tokenized: list[int] = []
        verifier = engines["verifier"]
        real = verifier.tokenize

        def tokenize(text: str) -> list[int]:
            self.tokenized.append(len(text))
            return real(text)

        monkeypatch.setattr(verifier, "tokenize", tokenize)

    async def start(self) -> Stack:
        self.drafter_server, dport = await start_drafter_server(self.engines["draft"])
        self.verifier_server, self.verifier_port = await start_verifier_server(self.engines["verifier"])
        self.verifier_address = f"127.0.0.1:{self.verifier_port}"
        self.orchestrator = Orchestrator(GrpcDrafterClient(f"127.0.0.1:{dport}", timeout_s=30),
                                         GrpcVerifierClient(self.verifier_address, timeout_s=30),
                                         OrchestratorConfig(pipeline=False))
        await self.orchestrator.start()
        self.server, port = await start_orchestrator_server(self.orchestrator)
        self.address = f"127.0.0.1:{port}"
        return self

    async def stop(self) -> None:
        await stop_server(self.server, 0.5)
        await self.orchestrator.close()
        await stop_server(self.drafter_server, 0.5)
        await stop_server(self.verifier_server, 0.5)

    async def call(self, payload: bytes) -> tuple[grpc.StatusCode, str, float]:
        """Generate with raw request bytes (up to 128 MB): status, details, seconds."""
        options = [("grpc.max_send_message_length", 128 * MB)]
        async with grpc.aio.insecure_channel(self.address, options=options) as channel:
            method = channel.unary_unary(GENERATE, request_serializer=None, response_deserializer=None)
            start = time.monotonic()
            try:
                await method(payload, timeout=120)
                code, details = grpc.StatusCode.OK, ""
            except grpc.aio.AioRpcError as exc:
                code, details = exc.code(), exc.details() or ""
            return code, details, time.monotonic() - start


@pytest.fixture
async def stack(engines, monkeypatch):
    started = await Stack(engines, monkeypatch).start()
    try:
        yield started
    finally:
        await started.stop()


def request(**fields: Any) -> bytes:
    base: dict[str, Any] = {"prompt_ids": common_pb2.TokenIds(ids=[1, 2, 3]), "max_new_tokens": 4, "seed": 1}
    base.update(fields)
    return generation_pb2.GenerationRequest(**base).SerializeToString()


def text_request(text: str) -> bytes:
    return generation_pb2.GenerationRequest(prompt=text, max_new_tokens=4, seed=1).SerializeToString()


async def test_a_prompt_over_max_prompt_bytes_never_reaches_the_verifier(stack) -> None:
    code, details, seconds = await stack.call(text_request("t1 " * (50 * MB // 3)))  # the 50 MB
    assert code == grpc.StatusCode.INVALID_ARGUMENT, details
    assert details == (f"prompt: {50 * MB // 3 * 3} UTF-8 bytes; at most {2 * MB} are allowed "
                       "(max_prompt_bytes)")
    assert seconds < FAST_S
    code, details, _ = await stack.call(text_request("é" * (2 * MB)))  # 2 Mi characters, 4 MiB
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith(f"prompt: {4 * MB} UTF-8 bytes")
    code, details, _ = await stack.call(text_request("é" * (2 * MB + 1)))  # its characters alone are too many
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith(f"prompt: at least {2 * MB + 1} ")
    assert stack.tokenized == []  # the verifier never saw them
    # Over gRPC's own 64 MB message limit, the orchestrator's transport refuses it unread.
    code, details, seconds = await stack.call(text_request("t1 " * (70 * MB // 3)))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in details
    assert seconds < FAST_S
    # A prompt within the limits is tokenized and generated as before.
    code, details, _ = await stack.call(text_request("t1 t2 t3"))
    assert code == grpc.StatusCode.OK, details
    assert stack.tokenized == [len("t1 t2 t3")]


LIMIT_CASES = [
    ("8 MB request_id", {"request_id": "r" * 8 * MB},
     f"request_id: {8 * MB} characters; at most 128 are allowed"),
    ("request_id with a space", {"request_id": "my request"},
     "request_id: only printable ASCII characters without spaces are allowed"),
    ("200,000 stop strings", {"stop": [f"s{i}" for i in range(200_000)]},
     "stop: 200000 stop strings; at most 16 are allowed"),
    ("a long stop string", {"stop": ["x" * 257]},
     "stop: a stop string of 257 characters; at most 256 are allowed"),
    ("300 stop token ids", {"stop_token_ids": common_pb2.TokenIds(ids=[1] * 300)},
     "stop_token_ids: 300 ids; at most 256 are allowed"),
    ("4M prompt ids", {"prompt_ids": common_pb2.TokenIds(ids=[1] * 4_000_000)},
     "prompt: 4000000 tokens leave no room in the target's context window of 128 tokens"),
    ("a with the token method", {"method": "token", "a": 0.5},
     "a: only rd uses a; leave it unset for method token"),
    ("temperature 1e-46", {"sampling": common_pb2.SamplingParams(temperature=1e-46)},
     "temperature must be 0 (greedy) or at least 0.0001, got 1e-46; use 0 for greedy"),
]


@pytest.mark.parametrize(("name", "fields", "message"), LIMIT_CASES, ids=[c[0] for c in LIMIT_CASES])
async def test_oversized_or_ignored_fields_fail_fast_naming_the_field(stack, name, fields, message) -> None:
    code, details, seconds = await stack.call(request(**fields))
    assert (code, details) == (grpc.StatusCode.INVALID_ARGUMENT, message)
    assert seconds < FAST_S


async def test_requests_within_the_limits_still_run(stack) -> None:
    for fields in ({"method": "rd", "a": 0.5}, {"request_id": "r" * 128, "stop": ["x" * 256] * 16},
                   {"sampling": common_pb2.SamplingParams(temperature=1e-4)}):
        code, details, _ = await stack.call(request(**fields))
        assert code == grpc.StatusCode.OK, (fields, details)


async def test_a_lost_verifier_is_unavailable_without_its_address(stack) -> None:
    await stop_server(stack.verifier_server, 0.0)
    port = str(stack.verifier_port)
    for payload in (request(), text_request("t1 t2")):
        code, details, _ = await stack.call(payload)
        assert code == grpc.StatusCode.UNAVAILABLE, details
        assert details and "127.0.0.1" not in details and port not in details, details


class CallsAPeer:
    """An orchestrator whose every request calls a verifier client, and fails as that call does."""

    def __init__(self, address: str) -> None:
        self.verifier = GrpcVerifierClient(address, timeout_s=10)

    async def generate(self, request: Any, **_: Any) -> Any:
        await self.verifier.tokenize("t1")
        raise AssertionError("the verifier answered")


async def test_a_peers_address_stays_in_the_server_log(caplog) -> None:
    """The status a client gets for a failed call to a peer names no address (grpc's own details
    name it: "ipv4:127.0.0.1:PORT: Failed to connect"); the server's log line keeps it."""
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{sock.getsockname()[1]}"
    peer = CallsAPeer(dead)
    server, port = await start_orchestrator_server(peer)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            method = channel.unary_unary(GENERATE, request_serializer=None, response_deserializer=None)
            with caplog.at_level(logging.INFO), pytest.raises(grpc.aio.AioRpcError) as caught:
                await method(request(), timeout=30)
    finally:
        await stop_server(server, 0.5)
        await peer.verifier.close()
    details = caught.value.details()
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    assert details.startswith("verifier unavailable (UNAVAILABLE)"), details
    assert "127.0.0.1" not in details and dead.rsplit(":", 1)[1] not in details, details
    logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Generate: UNAVAILABLE")]
    assert len(logged) == 1 and dead in logged[0], caplog.text


def test_the_orchestrator_limits_stay_within_the_engine_caps() -> None:
    OrchestratorConfig(max_k=MAX_LOOKAHEAD_K, max_tree_budget=MAX_TREE_NODES)
    with pytest.raises(ValidationError, match="max_k"):
        OrchestratorConfig(max_k=MAX_LOOKAHEAD_K + 1)
    with pytest.raises(ValidationError, match="max_tree_budget"):
        OrchestratorConfig(max_tree_budget=MAX_TREE_NODES + 1)

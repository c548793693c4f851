"""Request bytes that do not parse get INVALID_ARGUMENT "malformed request: …" and one log line, on
every specdec service and method kind (issue 14: it was UNKNOWN plus a traceback at ERROR per call)."""

from __future__ import annotations

import logging

import grpc
import pytest

from drafter_service.server import start_drafter_server
from orchestrator.server import start_orchestrator_server
from specdec.rpc.grpc_support import stop_server
from specdec.rpc.v1 import common_pb2, generation_pb2
from tests.services.helpers import FakeDrafter, FakeOrchestrator, FakeVerifier
from verifier_service.server import start_verifier_server

GARBAGE = b"\xff\xff\xff\xff garbage"

CASES = [  # (server, method path, response streaming)
    ("drafter", "/specdec.v1.DrafterService/Draft", False),
    ("drafter", "/specdec.v1.DrafterService/Lookahead", False),
    ("drafter", "/specdec.v1.DrafterService/DraftRows", False),
    ("drafter", "/specdec.v1.DrafterService/Release", False),
    ("verifier", "/specdec.v1.VerifierService/Tokenize", False),
    ("verifier", "/specdec.v1.VerifierService/Verify", False),
    ("verifier", "/specdec.v1.VerifierService/Info", False),
    ("orchestrator", "/specdec.v1.GenerationService/Generate", False),
    ("orchestrator", "/specdec.v1.GenerationService/GenerateStream", True),
    ("orchestrator", "/grpc.health.v1.Health/Check", False),
    ("verifier", "/grpc.health.v1.Health/Watch", True),
]


@pytest.fixture
async def servers():
    started = {
        "drafter": await start_drafter_server(FakeDrafter()),
        "verifier": await start_verifier_server(FakeVerifier()),
        "orchestrator": await start_orchestrator_server(FakeOrchestrator()),
    }
    try:
        yield {name: f"127.0.0.1:{port}" for name, (_, port) in started.items()}
    finally:
        for server, _ in started.values():
            await stop_server(server, 0.5)


async def _call(address: str, path: str, streaming: bool, payload: bytes) -> tuple[grpc.StatusCode, str]:
    async with grpc.aio.insecure_channel(address) as channel:
        kind = channel.unary_stream if streaming else channel.unary_unary
        call = kind(path, request_serializer=None, response_deserializer=None)
        try:
            if streaming:
                async for _ in call(payload, timeout=10):
                    pass
            else:
                await call(payload, timeout=10)
        except grpc.aio.AioRpcError as exc:
            return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""


@pytest.mark.parametrize(("server", "path", "streaming"), CASES, ids=[path for _, path, _ in CASES])
async def test_malformed_bytes_give_invalid_argument_and_one_log_line(
    servers, caplog, server: str, path: str, streaming: bool
) -> None:
    with caplog.at_level(logging.INFO):
        code, details = await _call(servers[server], path, streaming, GARBAGE)
    assert code == grpc.StatusCode.INVALID_ARGUMENT, details
    assert details.startswith("malformed request: Error parsing message")
    lines = [r for r in caplog.records if "malformed request" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == logging.INFO and lines[0].exc_info is None
    assert path in lines[0].getMessage()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info], caplog.text
    assert "Traceback" not in caplog.text


async def test_well_formed_requests_still_work(servers) -> None:
    request = generation_pb2.GenerationRequest(prompt_ids=common_pb2.TokenIds(ids=[1, 2]), max_new_tokens=2)
    code, _ = await _call(servers["orchestrator"], "/specdec.v1.GenerationService/Generate", False,
                          request.SerializeToString())
    assert code == grpc.StatusCode.OK
    code, _ = await _call(servers["verifier"], "/specdec.v1.VerifierService/Info", False, b"")
    assert code == grpc.StatusCode.OK

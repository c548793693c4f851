"""Engine servers a test can stop and start again on the same port (a restarted drafter or verifier,
possibly with another model), and a bounded wait for the orchestrator server's health status."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from drafter_service.server import start_drafter_server
from orchestrator.server import SERVICE_NAME
from specdec.rpc.grpc_support import stop_server
from verifier_service.server import start_verifier_server

HOST = "127.0.0.1"


class EngineServer:
    """One drafter or verifier gRPC server for an engine; `restart` serves another engine on the
    same port (what a supervisor restarting the process looks like to the orchestrator)."""

    def __init__(self, role: str) -> None:
        self.start_fn = start_drafter_server if role == "drafter" else start_verifier_server
        self.server: grpc.aio.Server | None = None
        self.port = 0

    @property
    def address(self) -> str:
        return f"{HOST}:{self.port}"

    async def start(self, engine: Any) -> EngineServer:
        assert self.server is None, "stop it first"
        self.server, self.port = await self.start_fn(engine, HOST, self.port)
        return self

    async def stop(self) -> None:
        server, self.server = self.server, None
        if server is not None:
            await stop_server(server, 0.0)

    async def restart(self, engine: Any) -> None:
        await self.stop()
        await self.start(engine)


async def health_status(port: int, service: str = SERVICE_NAME) -> str:
    """The orchestrator server's health status for `service` ('SERVING', 'NOT_SERVING', …)."""
    async with grpc.aio.insecure_channel(f"{HOST}:{port}") as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=2.0)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


async def wait_health(port: int, want: str, timeout_s: float = 15.0) -> float:
    """Poll until the status is `want` (bounded); returns the seconds it took."""
    start = time.monotonic()
    last = None
    while time.monotonic() - start < timeout_s:
        last = await health_status(port)
        if last == want:
            return time.monotonic() - start
        await asyncio.sleep(0.05)
    raise AssertionError(f"health still {last} after {timeout_s:g} s (wanted {want})")

"""`specdec serve orchestrator` with no verifier yet (issue 12/14): it listens at once, NOT_SERVING,
answers requests UNAVAILABLE "verifier not ready" (no internal address), warns after --peer-timeout
but never exits; once the verifier answers it turns SERVING and only then writes its ready file (what
`specdec up` waits for). A real orchestrator process; the verifier is served by this test."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import grpc  # noqa: E402
import pytest  # noqa: E402

from specdec.engine.verifier import VerifierEngine  # noqa: E402
from specdec.rpc.grpc_support import stop_server  # noqa: E402
from specdec.rpc.v1 import common_pb2, generation_pb2, generation_pb2_grpc  # noqa: E402
from specdec.runtime.loading import load_model  # noqa: E402
from tests.orchestrator.engine_servers import health_status  # noqa: E402
from verifier_service.server import start_verifier_server  # noqa: E402

from .helpers import ROOT, STARTUP_TIMEOUT_S, cli_argv, cli_env  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(int(STARTUP_TIMEOUT_S) + 120)]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def _status_or_none(port: int) -> str | None:
    try:
        return await health_status(port)
    except grpc.aio.AioRpcError:
        return None


async def _wait_status(port: int, want: str, process: subprocess.Popen, log, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        assert process.poll() is None, f"the orchestrator exited with {process.returncode}:\n{log()}"
        last = await _status_or_none(port)
        if last == want:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"health {last}, not {want}, after {timeout_s:g} s:\n{log()}")


async def test_the_orchestrator_waits_not_serving_for_a_late_verifier(tiny_models, tmp_path):
    verifier_port, port = _free_port(), _free_port()
    ready = tmp_path / "orchestrator.ready.json"
    log_path = tmp_path / "orchestrator.log"
    argv = cli_argv("serve", "orchestrator", "--verifier", f"127.0.0.1:{verifier_port}",
                    "--drafter", f"127.0.0.1:{_free_port()}", "--port", str(port), "--peer-timeout", "1",
                    "--ready-file", str(ready))
    with open(log_path, "w") as log_file:
        process = subprocess.Popen(argv, stdout=log_file, stderr=subprocess.STDOUT, env=cli_env(), cwd=ROOT,
                                   stdin=subprocess.DEVNULL, start_new_session=True)

    def log() -> str:
        return log_path.read_text(errors="replace")

    verifier = None
    request = generation_pb2.GenerationRequest(prompt_ids=common_pb2.TokenIds(ids=[1, 2]), max_new_tokens=3)
    try:
        await _wait_status(port, "NOT_SERVING", process, log, STARTUP_TIMEOUT_S)
        assert not ready.exists()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = generation_pb2_grpc.GenerationServiceStub(channel)
            started = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.Generate(request, timeout=30)
            assert time.monotonic() - started < 2.0
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
            assert caught.value.details().startswith("verifier not ready"), caught.value.details()
            assert str(verifier_port) not in caught.value.details()

            for _ in range(100):  # bounded: the warning comes after --peer-timeout (1 s)
                if "still waiting" in log():
                    break
                await asyncio.sleep(0.1)
            assert "still waiting" in log() and process.poll() is None
            assert await health_status(port) == "NOT_SERVING" and not ready.exists()

            engine = VerifierEngine(load_model(tiny_models.target, threads=1))
            verifier, _ = await start_verifier_server(engine, "127.0.0.1", verifier_port)
            await _wait_status(port, "SERVING", process, log, 30)
            for _ in range(100):  # bounded: written right after the first successful start
                if ready.exists():
                    break
                await asyncio.sleep(0.1)
            assert ready.exists(), log()
            result = await stub.Generate(request, timeout=60)
            assert len(result.token_ids) >= 1
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)
        if verifier is not None:
            await stop_server(verifier, 0.5)

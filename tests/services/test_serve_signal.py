"""serve_* runs until SIGTERM / SIGINT and then stops cleanly (a real child process, bounded waits)."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import asyncio, logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s %(message)s")
from tests.services.helpers import FakeDrafter, FakeOrchestrator
kind = sys.argv[1]
if kind == "drafter":
    from drafter_service.server import serve_drafter as serve
    target = FakeDrafter()
else:
    from orchestrator.server import serve_orchestrator as serve
    target = FakeOrchestrator()
asyncio.run(serve(target, "127.0.0.1", 0, grace_s=1.0))
print("clean exit", file=sys.stderr)
"""


def line_reader(process: subprocess.Popen) -> queue.Queue:
    lines: queue.Queue = queue.Queue()

    def pump() -> None:
        for line in process.stderr:
            lines.put(line)

    threading.Thread(target=pump, daemon=True).start()
    return lines


def read_until(lines: queue.Queue, pattern: str, timeout_s: float) -> re.Match:
    deadline = time.monotonic() + timeout_s
    seen = ""
    while (left := deadline - time.monotonic()) > 0:
        try:
            line = lines.get(timeout=left)
        except queue.Empty:
            break
        seen += line
        match = re.search(pattern, line)
        if match:
            return match
    raise AssertionError(f"no {pattern!r} within {timeout_s} s; output so far:\n{seen}")


@pytest.mark.timeout(90)
@pytest.mark.parametrize(("kind", "sig"), [("drafter", signal.SIGTERM), ("orchestrator", signal.SIGINT)])
def test_serve_until_signal(kind: str, sig: signal.Signals) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    process = subprocess.Popen(
        [sys.executable, "-c", SCRIPT, kind], cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True
    )
    lines = line_reader(process)
    try:
        port = int(read_until(lines, r"serving .* on 127\.0\.0\.1:(\d+)", 60).group(1))
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            response = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert response.status == health_pb2.HealthCheckResponse.SERVING
        process.send_signal(sig)
        read_until(lines, "clean exit", 15)
        assert process.wait(timeout=15) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=10)

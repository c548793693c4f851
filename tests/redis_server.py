"""A redis-server of a test's own, on a free loopback port, that the test can kill and restart
(the session-wide `redis_url` fixture of tests/orchestrator/conftest.py must stay up for others),
or pause (SIGSTOP) to hang it."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

START_TIMEOUT_S = 10.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def redis_binary() -> str:
    """The redis-server executable; skips the test without one (fails it when CI is set)."""
    binary = shutil.which("redis-server")
    if binary is None:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail("redis-server is not installed, and CI is set: the Redis store must be tested")
        pytest.skip("redis-server is not installed (apt-get install redis-server); CI would fail here")
    return binary


class RedisServer:
    """One redis-server process (no persistence): start, kill -9, start again on the same port."""

    def __init__(self, workdir: Path) -> None:
        self.binary = redis_binary()
        self.workdir = workdir
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        import redis

        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.workdir), "--protected-mode", "yes"],
            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
        )
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_connect_timeout=0.5, socket_timeout=0.5)
        deadline = time.monotonic() + START_TIMEOUT_S
        try:
            while True:
                try:
                    client.ping()
                    return self
                except redis.exceptions.ConnectionError:
                    if self.proc.poll() is not None or time.monotonic() > deadline:
                        self.stop()
                        pytest.fail(f"redis-server did not start on port {self.port}")
                    time.sleep(0.05)
        finally:
            client.close()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """SIGSTOP for the block, SIGCONT after it (whatever happens): a hung Redis, which accepts
        connections (the kernel does) but answers nothing."""
        assert self.proc is not None and self.proc.poll() is None, "start the server first"
        self.proc.send_signal(signal.SIGSTOP)
        try:
            yield
        finally:
            self.proc.send_signal(signal.SIGCONT)

    def kill(self) -> None:
        """kill -9, as an outage would."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)

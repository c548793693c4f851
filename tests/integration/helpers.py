"""Helpers of the end-to-end tests: the CLI as a subprocess, `specdec up`, process checks.

Every wait is bounded, and every process a test starts is stopped in teardown, also when the
test fails (children of `up` are tracked through its ready file and killed by pid if needed).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.helpers import wait_for_ready_file

ROOT = Path(__file__).resolve().parents[2]
# Startup of one service imports torch + transformers; on a busy 2-core machine that alone can
# take tens of seconds, so the bound is generous (it is only reached when something is broken).
STARTUP_TIMEOUT_S = 240.0
CLI_TIMEOUT_S = 180.0
TINY_CONTEXT = 1024


def cli_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", COLUMNS="200", NO_COLOR="1", TERM="dumb")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def cli_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "specdec.cli", *args]


def run_cli(*args: str, timeout: float = CLI_TIMEOUT_S) -> subprocess.CompletedProcess:
    """Run `specdec ARGS` to completion (bounded) and return its output."""
    return subprocess.run(cli_argv(*args), capture_output=True, text=True, timeout=timeout, env=cli_env(),
                          cwd=ROOT, stdin=subprocess.DEVNULL)


def json_lines(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.strip()]


def pid_alive(pid: int) -> bool:
    """True while the process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            state = handle.read().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def wait_gone(pids, timeout: float) -> list[int]:
    """Wait (bounded) until none of `pids` is alive; returns those still alive."""
    deadline = time.monotonic() + timeout
    alive = [p for p in pids if pid_alive(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.1)
        alive = [p for p in alive if pid_alive(p)]
    return alive


def kill_pids(pids) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


class UpProcess:
    """`specdec up` as a subprocess, with every port chosen by the OS and a ready file."""

    def __init__(self, workdir: Path, *args: str) -> None:
        self.ready_file = workdir / "up.ready.json"
        self.log_dir = workdir / "logs"
        self.stderr_path = workdir / "up.stderr"
        argv = cli_argv("up", "--port", "0", "--drafter-port", "0", "--verifier-port", "0",
                        "--http-port", "0", "--ready-file", str(self.ready_file),
                        "--log-dir", str(self.log_dir), "--startup-timeout", str(STARTUP_TIMEOUT_S), *args)
        self._stderr = open(self.stderr_path, "w")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=self._stderr, env=cli_env(),
                                        cwd=ROOT, stdin=subprocess.DEVNULL, start_new_session=True)
        self.info: dict = {}

    @property
    def child_pids(self) -> list[int]:
        pids = dict(self.info.get("pids", {}))
        # Children that had started before `up` wrote its ready file leave their own ready files.
        for ready in self.log_dir.glob("*.ready.json") if self.log_dir.exists() else []:
            with contextlib.suppress(ValueError, OSError, KeyError):
                pids.setdefault(ready.name.split(".")[0], json.loads(ready.read_text())["pid"])
        return [int(pid) for pid in pids.values()]

    def stderr(self) -> str:
        self._stderr.flush()
        return self.stderr_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 3 * STARTUP_TIMEOUT_S) -> dict:
        self.info = wait_for_ready_file(
            self.ready_file, self.process, "`specdec up`", self.stderr, timeout, poll_s=0.2
        )
        return self.info

    def wait_exit(self, timeout: float) -> int:
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            message = f"`specdec up` still running after {timeout:.0f}s:\n{self.stderr()}"
            raise AssertionError(message) from None

    def stop(self) -> None:
        """Teardown: SIGTERM `up`, then make sure nothing it started survives."""
        children = self.child_pids
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        kill_pids(wait_gone(children, 15))
        self._stderr.close()


def invoke_cli(*args: str):
    """Run the CLI inside this process (typer's CliRunner): the same code, without a new interpreter.

    Cheaper than run_cli when torch is already imported here; returns exit_code, stdout, stderr.
    """
    from typer.testing import CliRunner

    from specdec.cli import app

    return CliRunner().invoke(app, list(args), env={"COLUMNS": "200", "NO_COLOR": "1"})

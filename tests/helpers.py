"""Helpers shared by several test folders (the per-folder ones live in tests/<folder>/helpers*.py)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def wait_for_ready_file(
    ready_file: Path, process: subprocess.Popen, what: str, log: Callable[[], str], timeout_s: float,
    poll_s: float = 0.1,
) -> dict[str, Any]:
    """The JSON a server writes once serving (--ready-file); fails with its log if the process
    exits first or the file does not appear within `timeout_s` (a bounded wait)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if ready_file.exists():
            with contextlib.suppress(json.JSONDecodeError):
                return json.loads(ready_file.read_text())
        if process.poll() is not None:
            raise AssertionError(f"{what} exited with {process.returncode}:\n{log()}")
        time.sleep(poll_s)
    raise AssertionError(f"{what} not ready within {timeout_s:.0f}s:\n{log()}")


def use_draft_rows(monkeypatch: Any, mode: str) -> None:
    """Every RunSessions the orchestrator makes from now on (this test) sends its draft rows `mode`
    ("lean" | "full", docs/algorithms.md §12), whatever the config says."""
    from orchestrator import speculation
    from orchestrator.sessions import RunSessions

    class Sessions(RunSessions):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **{**kwargs, "draft_rows": mode})

    monkeypatch.setattr(speculation, "RunSessions", Sessions)


# The torch device of the tests that take one (marked `device`, tests/conftest.py): "cpu" unless
# SPECDEC_TEST_DEVICE (or pytest --test-device) names another, e.g. "cuda" on the GPU machine.
TEST_DEVICE_VARIABLE = "SPECDEC_TEST_DEVICE"
_DEVICE_SPELLING = re.compile(r"cpu|cuda(:\d+)?|mps")


def device_under_test() -> str:
    """SPECDEC_TEST_DEVICE, default "cpu"; ValueError on a spelling torch would not take."""
    device = os.environ.get(TEST_DEVICE_VARIABLE, "").strip() or "cpu"
    if not _DEVICE_SPELLING.fullmatch(device):
        raise ValueError(f"{TEST_DEVICE_VARIABLE}={device!r}: not a device (cpu, cuda, cuda:N or mps)")
    return device

"""The light client stays light: importing specdec.client, and `specdec generate --address …` (server mode),
import neither torch, transformers nor numpy (checked in a fresh interpreter, where nothing is cached)."""

from __future__ import annotations

import subprocess
import sys

from tests.integration.helpers import ROOT, cli_env
from tests.redis_server import free_port

HEAVY = ("torch", "transformers", "numpy")
SUBPROCESS_TIMEOUT_S = 120


def _imported_top_level(stderr: str) -> set[str]:
    """Top-level packages named by `python -X importtime` (its lines end with '| module.name')."""
    return {line.rsplit("|", 1)[1].strip().split(".")[0] for line in stderr.splitlines()
            if line.startswith("import time:") and "|" in line}


def test_importing_the_client_imports_no_torch() -> None:
    code = ("import sys\nfrom specdec.client import AsyncClient, Client, GenerationRequest, InvalidRequest\n"
            f"heavy = [m for m in {HEAVY!r} if m in sys.modules]\n"
            "assert 'grpc' in sys.modules, 'the probe sees what the client imports'\n"
            "assert not heavy, heavy\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=SUBPROCESS_TIMEOUT_S, env=cli_env(), cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]


def test_generate_in_server_mode_imports_no_torch() -> None:
    """The whole command against an address where nothing listens: the request is built, sent with the
    light client, fails UNAVAILABLE and is explained; torch never loads (it would cost seconds)."""
    address = f"127.0.0.1:{free_port()}"
    argv = [sys.executable, "-X", "importtime", "-c",
            "import sys; sys.argv[0] = 'specdec'; from specdec.cli import app; app()",  # the console script
            "generate", "--address", address, "--max-new-tokens", "4", "--temperature", "0", "def f"]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S, env=cli_env(),
                            cwd=ROOT, stdin=subprocess.DEVNULL)
    assert result.returncode == 1, result.stderr[-2000:]
    assert f"UNAVAILABLE: no orchestrator answers at {address}" in result.stderr, result.stderr[-2000:]
    assert "| specdec.client" in result.stderr  # the request went through the light client
    imported = _imported_top_level(result.stderr)
    assert not imported & set(HEAVY), sorted(imported & set(HEAVY))

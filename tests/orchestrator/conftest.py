"""Fixtures for the orchestrator tests: tiny real models + engines (session-scoped), wrappers that
inject faults, a real Redis server, and plain-forward references to compare the real code path with."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402

from orchestrator.clients.inprocess import InProcessDrafterClient, InProcessVerifierClient  # noqa: E402
from orchestrator.config import OrchestratorConfig  # noqa: E402
from orchestrator.speculation import Orchestrator  # noqa: E402
from orchestrator.store import Store  # noqa: E402
from specdec.engine.drafter import DrafterEngine  # noqa: E402
from specdec.engine.verifier import VerifierEngine  # noqa: E402
from specdec.runtime.loading import load_model  # noqa: E402
from specdec.runtime.prefix_cache import PrefixStore  # noqa: E402
from specdec.runtime.tiny import save_tiny_model  # noqa: E402

VOCAB = 6
MODEL_SEEDS = {"target": 101, "draft": 202, "draft2": 303}


@pytest.fixture(autouse=True)
def draft_model_source(request, monkeypatch) -> None:
    """The loop's tests are about the draft model (its adaptation, look-ahead, failover): their
    orchestrators draft from it alone (SPECDEC_DRAFT_SOURCE=model), so that a model-free draft of
    the tiny models' repetitive output does not stand in for the drafter they watch. Modules about
    the sources themselves set KEEPS_DRAFT_SOURCE_DEFAULT = True and get the hybrid default."""
    if not getattr(request.module, "KEEPS_DRAFT_SOURCE_DEFAULT", False):
        monkeypatch.setenv("SPECDEC_DRAFT_SOURCE", "model")


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-models")
    dirs = {name: save_tiny_model(root / name, vocab_size=VOCAB, seed=seed)
            for name, seed in MODEL_SEEDS.items()}
    dirs["vocab5"] = save_tiny_model(root / "vocab5", vocab_size=5, seed=404)
    return dirs


@pytest.fixture(scope="session")
def loaded(model_dirs):
    models = {name: load_model(path, threads=1) for name, path in model_dirs.items()}
    models["target_copy"] = load_model(model_dirs["target"], threads=1)  # drafter = target, own weights
    return models


# The engines' prefix caches are on, as `serve` has them, in blocks small enough that the tests' short
# prompts and answers fill some: every law and fidelity test of the loop runs with cache hits.
TEST_PREFIX_BLOCK = 4


def prefix_cache() -> PrefixStore:
    return PrefixStore(max_bytes=64 << 20, block_tokens=TEST_PREFIX_BLOCK)


@pytest.fixture(scope="session")
def engines(loaded):
    """One verifier engine on the target and a drafter engine per draft model (the target included)."""
    return {
        "verifier": VerifierEngine(loaded["target"], prefix_cache=prefix_cache()),
        "draft": DrafterEngine(loaded["draft"], prefix_cache=prefix_cache()),
        "draft2": DrafterEngine(loaded["draft2"], prefix_cache=prefix_cache()),
        "self": DrafterEngine(loaded["target_copy"], prefix_cache=prefix_cache()),
        "vocab5": DrafterEngine(loaded["vocab5"], prefix_cache=prefix_cache()),
    }


@pytest.fixture
def make_orchestrator(engines) -> Callable[..., Orchestrator]:
    """make_orchestrator(drafter="draft" | None | a client, store=None, **config fields)."""

    def make(drafter: object = "draft", store: Store | None = None, on_iteration=None,
             **config) -> Orchestrator:
        if isinstance(drafter, str):
            drafter = InProcessDrafterClient(engines[drafter])
        verifier = InProcessVerifierClient(engines["verifier"])
        config.setdefault("pipeline", False)  # the loop's own tests are about sequential iterations
        config = OrchestratorConfig(**config)
        return Orchestrator(drafter, verifier, config, store=store, on_iteration=on_iteration)

    return make


# ------------------------------------------------------------------------------------------------
# a real Redis server


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory):
    binary = shutil.which("redis-server")
    if binary is None:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail("redis-server is not installed, and CI is set: the Redis store must be tested")
        pytest.skip("redis-server is not installed (apt-get install redis-server); CI would fail here")
    workdir = tmp_path_factory.mktemp("redis")
    port = _free_port()
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", str(workdir), "--protected-mode", "yes"],
        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
    )
    try:
        import redis

        client = redis.Redis(host="127.0.0.1", port=port, socket_connect_timeout=0.5, socket_timeout=0.5)
        deadline = time.monotonic() + 10.0
        while True:
            try:
                client.ping()
                break
            except redis.exceptions.ConnectionError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"redis-server did not start on port {port} (exit code {proc.poll()})")
                time.sleep(0.05)
        client.close()
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)

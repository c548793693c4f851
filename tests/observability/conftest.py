"""Fixtures of the observability tests: tiny random models (vocab 8) and engines, built once."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402

VOCAB = 8
CONTEXT = 1024


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    from specdec.runtime.tiny import save_tiny_model

    root = tmp_path_factory.mktemp("obs-tiny")
    return {name: save_tiny_model(root / name, vocab_size=VOCAB, seed=seed, max_position_embeddings=CONTEXT)
            for name, seed in (("draft", 11), ("target", 12))}


@pytest.fixture(scope="session")
def tiny_loaded(tiny_dirs):
    from specdec.runtime.loading import load_model

    return {name: load_model(path, threads=1) for name, path in tiny_dirs.items()}


@pytest.fixture
def engines(tiny_loaded):
    """Fresh engines per test (session counters start at zero) over the shared models."""
    from specdec.engine.drafter import DrafterEngine
    from specdec.engine.verifier import VerifierEngine

    return DrafterEngine(tiny_loaded["draft"]), VerifierEngine(tiny_loaded["target"])


@pytest.fixture(autouse=True)
def _no_otel_env(monkeypatch):
    """Tests decide where spans go; a developer's OTEL_* settings must not leak in."""
    for key in list(os.environ):
        if key.startswith("OTEL_"):
            monkeypatch.delenv(key)

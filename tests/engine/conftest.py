"""Tiny draft/target pair for the engine tests (built once per session, no download)."""

from __future__ import annotations

import pytest

from specdec.engine.drafter import DrafterEngine
from specdec.engine.verifier import VerifierEngine
from specdec.runtime.loading import load_model
from specdec.runtime.tiny import save_tiny_model


@pytest.fixture(scope="session")
def draft_model(tmp_path_factory):
    path = save_tiny_model(
        tmp_path_factory.mktemp("draft") / "d8",
        vocab_size=8,
        seed=3,
        hidden_size=16,
        num_layers=2,
        logit_scale=4.0,
    )
    return load_model(path)


@pytest.fixture(scope="session")
def target_model(tmp_path_factory):
    path = save_tiny_model(
        tmp_path_factory.mktemp("target") / "t8",
        vocab_size=8,
        seed=3,
        hidden_size=32,
        num_layers=3,
        logit_scale=6.0,
        max_position_embeddings=64,
    )
    return load_model(path)


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Tiny models run far faster on one thread (and the test machine's cores are shared)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def drafter(draft_model):
    return DrafterEngine(draft_model)


@pytest.fixture
def verifier(target_model):
    return VerifierEngine(target_model)

"""Tiny random models shared by the runtime tests (built once per session, no download)."""

from __future__ import annotations

import pytest

from specdec.runtime.loading import load_model
from specdec.runtime.tiny import save_tiny_model


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    return save_tiny_model(
        tmp_path_factory.mktemp("tiny") / "m8",
        vocab_size=8,
        seed=3,
        hidden_size=32,
        num_layers=3,
        logit_scale=6.0,
    )


@pytest.fixture(scope="session", params=["sdpa", "eager"])
def tiny(request, tiny_dir):
    """The same tiny model under both attention implementations that honour custom 4D masks."""
    return load_model(tiny_dir, attn_implementation=request.param)


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Tiny models run far faster on one thread (and the test machine's cores are shared)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)

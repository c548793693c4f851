"""Fixtures of the end-to-end tests: tiny random models on disk (vocab 6-8, built once per session)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from .helpers import TINY_CONTEXT


@dataclass
class TinyModels:
    draft: Path
    target: Path
    other_vocab: Path  # a draft model whose vocabulary differs from the target's


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> TinyModels:
    from specdec.runtime.tiny import save_tiny_model

    root = tmp_path_factory.mktemp("tiny-models")

    def save(name: str, vocab: int, seed: int) -> Path:
        return save_tiny_model(root / name, vocab_size=vocab, seed=seed, max_position_embeddings=TINY_CONTEXT)

    return TinyModels(draft=save("draft", 8, 1), target=save("target", 8, 2), other_vocab=save("other", 6, 3))

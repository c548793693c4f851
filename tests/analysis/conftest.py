"""Tiny random draft/target models shared by the analyser and harness tests (no download)."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402

VOCAB = 6


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    from specdec.runtime.tiny import save_tiny_model

    root = tmp_path_factory.mktemp("analysis-tiny")
    return {
        "target": save_tiny_model(root / "target", vocab_size=VOCAB, seed=101),
        "draft": save_tiny_model(root / "draft", vocab_size=VOCAB, seed=202),
    }


@pytest.fixture(scope="session")
def tiny_models(tiny_dirs):
    from specdec.runtime.loading import load_model

    return {name: load_model(path, threads=1) for name, path in tiny_dirs.items()}


@pytest.fixture(scope="session")
def tiny_analysis(tiny_models):
    """One analysis of the tiny pair (2 prompts × 12 tokens), shared by the read-only tests."""
    from specdec.analysis import analyze
    from specdec.sampling import SamplingParams

    analysis, rows = analyze(
        tiny_models["target"].model,
        tiny_models["draft"].model,
        [[1, 2, 3], [2, 2, 4, 1]],
        SamplingParams(1.0),
        max_new_tokens=12,
        seed=3,
        draft_id="tiny-draft",
        target_id="tiny-target",
        timing_repeats=2,
        rank_samples=64,
        sim_samples=2,
        max_budget=8,
        k_max=6,
    )
    return analysis, rows

"""Tiny draft/target pair for the engine tests (built once per session, no download)."""

from __future__ import annotations

import pytest

from specdec.engine.drafter import DrafterEngine
from specdec.engine.verifier import VerifierEngine
from specdec.runtime.kv_pool import PoolConfig
from specdec.runtime.loading import load_model
from specdec.runtime.tiny import save_tiny_model
from tests.helpers import device_under_test


@pytest.fixture(scope="session")
def draft_model(tmp_path_factory):
    return load_model(_draft_path(tmp_path_factory))


def _draft_path(tmp_path_factory):
    return save_tiny_model(
        tmp_path_factory.mktemp("draft") / "d8",
        vocab_size=8,
        seed=3,
        hidden_size=16,
        num_layers=2,
        logit_scale=4.0,
    )


@pytest.fixture(scope="session")
def target_model(tmp_path_factory):
    return load_model(_target_path(tmp_path_factory))


def _target_path(tmp_path_factory):
    return save_tiny_model(
        tmp_path_factory.mktemp("target") / "t8",
        vocab_size=8,
        seed=3,
        hidden_size=32,
        num_layers=3,
        logit_scale=6.0,
        max_position_embeddings=64,
    )


# The same pair on SPECDEC_TEST_DEVICE (tests.helpers.device_under_test), for the tests marked
# `device`: on the CPU the very models above; with SPECDEC_TEST_DEVICE=cuda copies on the GPU.
@pytest.fixture(scope="session")
def device_draft_model(draft_model, tmp_path_factory):
    device = device_under_test()
    return draft_model if device == "cpu" else load_model(_draft_path(tmp_path_factory), device=device)


@pytest.fixture(scope="session")
def device_target_model(target_model, tmp_path_factory):
    device = device_under_test()
    return target_model if device == "cpu" else load_model(_target_path(tmp_path_factory), device=device)


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


def small_pool(device: str) -> PoolConfig:
    """A small KV pool for the tiny pair: captured CUDA graphs on CUDA, the same pool run eagerly on
    the CPU (so the pooled cache's indexing and masks are tested here too)."""
    return PoolConfig(slots=3, slot_tokens=48, query_buckets=(1, 2, 4, 8, 16), batch_buckets=(1, 2, 4),
                      context_buckets=(16, 32), capture=device.startswith("cuda"))


# The device tests' engines run twice: on eager growing caches (the CPU default, the --no-cuda-graphs
# fallback) and on a KV pool with captured passes (the CUDA default).
@pytest.fixture(params=["eager", "pooled"])
def cache_kind(request) -> str:
    return request.param


@pytest.fixture
def device_drafter(device_draft_model, cache_kind):
    pool = small_pool(device_under_test()) if cache_kind == "pooled" else None
    return DrafterEngine(device_draft_model, kv_pool=pool)


@pytest.fixture
def device_verifier(device_target_model, cache_kind):
    pool = small_pool(device_under_test()) if cache_kind == "pooled" else None
    return VerifierEngine(device_target_model, kv_pool=pool)

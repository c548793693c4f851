"""A prompt is prefilled in chunks: at int8 the cache and the next row are bitwise those of one pass,
and a batching runner gets one pass per chunk (other sessions' passes may run between them)."""

from __future__ import annotations

import torch

from specdec.runtime import kv as kv_module
from specdec.runtime.kv import TreeKVCache, prefill_chunk
from specdec.runtime.loading import quantize_int8
from specdec.runtime.tiny import build_tiny_model


def _int8_model():
    torch.set_num_threads(2)
    return quantize_int8(build_tiny_model(vocab_size=48, seed=7, hidden_size=64, num_layers=2,
                                          max_position_embeddings=256))


def _prefilled(model, tokens, chunk, monkeypatch):
    monkeypatch.setattr(kv_module, "PREFILL_CHUNK", chunk)
    kv = TreeKVCache(model)
    kv.prefill(tokens)
    return kv


def test_chunked_prefill_is_bitwise_one_pass_at_int8(monkeypatch):
    model = _int8_model()
    tokens = [(7 * i + 3) % 48 for i in range(70)]
    with torch.inference_mode():
        whole = _prefilled(model, tokens, 1000, monkeypatch)
        chunked = _prefilled(model, tokens, 16, monkeypatch)
        assert chunked.prefix == whole.prefix == tokens
        for (k1, v1), (k2, v2) in zip(whole.layer_states(), chunked.layer_states(), strict=True):
            assert torch.equal(k1, k2) and torch.equal(v1, v2)
        assert torch.equal(whole.extend_chain([5]), chunked.extend_chain([5]))


def test_a_runner_gets_one_pass_per_chunk(monkeypatch):
    model = _int8_model()
    model.specdec_int8_wide_rows = None  # the chunk is the CPU's alone, whatever the kernels measured
    model.specdec_int8_wide_kernel = None
    passes = []

    class Runner:
        def alone(self, run):
            passes.append(run)
            run()

    monkeypatch.setattr(kv_module, "PREFILL_CHUNK", 16)
    kv = TreeKVCache(model)
    kv.runner = Runner()
    with torch.inference_mode():
        kv.prefill(list(range(40)))
    assert len(passes) == 3 and kv.prefix_len == 40  # 16 + 16 + 8


def test_chunk_sizes_by_device_and_the_int8_models_wide_kernel():
    assert prefill_chunk("cpu") == prefill_chunk("cuda") == kv_module.PREFILL_CHUNK == 512

    class Model:
        specdec_int8_wide_rows = None
        specdec_int8_wide_kernel = None

    model = Model()
    assert prefill_chunk("cpu", model) == kv_module.PREFILL_CHUNK
    model.specdec_int8_wide_rows = 1024  # a wide kernel that takes over from 1024 rows: chunks that wide
    model.specdec_int8_wide_kernel = "int_mm"
    assert prefill_chunk("cpu", model) == 1024
    assert prefill_chunk("cuda", model) == kv_module.PREFILL_CHUNK  # the CPU's kernels only
    model.specdec_int8_wide_rows = 16
    model.specdec_int8_wide_kernel = "onednn"
    assert prefill_chunk("cpu", model) == kv_module.PREFILL_CHUNK

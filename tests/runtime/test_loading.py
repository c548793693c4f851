"""Loading models: HF directories, GGUF files (converted once, cached by content), errors."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from specdec.runtime import loading
from specdec.runtime.int8 import RowwiseInt8Linear, quantize_linears, use_invariant_attention
from specdec.runtime.layer_kernels import use_layer_kernels
from specdec.runtime.loading import ModelPathError, cached_sha256, convert_gguf, load_model
from specdec.runtime.tiny import build_tiny_model
from specdec.runtime.tokenizers import load_tokenizer, tokenizer_fingerprint

_PER_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def write_tiny_gguf(path: Path, quantize: bool = False, seed: int = 0):
    """A tiny Qwen2 model written as GGUF the way llama.cpp lays it out (byte-level BPE vocab of 8).

    Returns the HF model and, per HF tensor name, the values the GGUF file really holds
    (the dequantised ones when `quantize`).
    """
    import gguf
    from gguf import quants

    model = build_tiny_model(
        vocab_size=8, seed=seed, hidden_size=32, num_layers=2, max_position_embeddings=96
    )
    cfg = model.config
    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(["a", "b", "c", "d", "e", "f", "ab", "<|end|>"])
    writer.add_token_types([1] * 7 + [3])
    writer.add_token_merges(["a b"])
    writer.add_eos_token_id(7)
    names = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    for i in range(cfg.num_hidden_layers):
        names.update({f"model.layers.{i}.{hf}": f"blk.{i}.{gg}" for hf, gg in _PER_LAYER.items()})
    stored = {}
    for name, tensor in model.state_dict().items():
        array = tensor.detach().numpy().astype(np.float32)
        if quantize and array.ndim == 2:
            q8 = gguf.GGMLQuantizationType.Q8_0
            packed = quants.quantize(array, q8)
            writer.add_tensor(names[name], packed, raw_dtype=q8)
            stored[name] = torch.from_numpy(quants.dequantize(packed, q8).reshape(array.shape).copy())
        else:
            writer.add_tensor(names[name], array)
            stored[name] = torch.from_numpy(array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model, stored


def test_hf_directory_info(tiny_dir):
    environment = dict(os.environ)
    loaded = load_model(tiny_dir)
    # Loading is local_files_only: it sets no variable but the CPU attention switch (loading.py says
    # why), which an earlier load in the same process may have set already.
    after = dict(os.environ)
    assert after.pop("TRANSFORMERS_SDPA_FORCE_GQA", None) in (None, "1")
    environment.pop("TRANSFORMERS_SDPA_FORCE_GQA", None)
    assert after == environment
    info = loaded.info
    assert info.model_id == tiny_dir.name
    assert info.vocab_size == 8 and info.max_context == 128 and info.eos_token_ids == (7,)
    assert info.tokenizer_fingerprint == tokenizer_fingerprint(load_tokenizer(tiny_dir))
    assert (info.device, info.dtype) == ("cpu", "float32")
    assert not loaded.model.training
    assert loaded.model.config._attn_implementation == "sdpa"


def test_auto_precision_is_int8_on_a_cpu(tiny_dir):
    loaded = load_model(tiny_dir, dtype="auto")
    assert loaded.info.dtype == "int8"
    assert any(isinstance(m, RowwiseInt8Linear) for m in loaded.model.modules())


def test_int8_quantises_every_linear_and_stays_close(tiny_dir):
    from specdec.engine.api import DraftRequest
    from specdec.engine.drafter import DrafterEngine
    from specdec.sampling import SamplingParams

    exact, quantised = load_model(tiny_dir), load_model(tiny_dir, dtype="int8")
    assert (quantised.info.dtype, quantised.info.vocab_size) == ("int8", exact.info.vocab_size)
    assert quantised.info.model_id == f"{exact.info.model_id}@int8"  # its own calibration key
    linear = [m for m in quantised.model.modules() if type(m) is torch.nn.Linear]
    dynamic = [m for m in quantised.model.modules() if isinstance(m, RowwiseInt8Linear)]
    assert not linear and dynamic
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        p = torch.softmax(exact.model(ids).logits, -1)
        q = torch.softmax(quantised.model(ids).logits, -1)
    assert 0 < (p - q).abs().sum(-1).max() < 0.2  # changed (it is another distribution), but slightly
    # the engines' cached, masked forward paths work on the quantised modules
    result = DrafterEngine(quantised).draft(DraftRequest(
        "s", 0, [1, 2, 3], [-1, 0, 1], SamplingParams(1.0), seed=1, want_distributions=True))
    assert len(result.tokens) == 3 and torch.allclose(result.draft_probs[:3].sum(-1), torch.ones(3))


def _mappings_of(path) -> int:
    with open("/proc/self/maps") as maps:
        return sum(str(path) in line for line in maps)


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads Linux's /proc/self/maps")
def test_int8_lets_go_of_the_weights_file_and_keeps_its_logits(tiny_dir):
    """The int8 model keeps no view of the memory-mapped float32 file (its pages would stay resident),
    and copying out what it keeps changes no logit against quantising the model in memory."""
    import gc

    weights = next(Path(tiny_dir).glob("*.safetensors")).resolve()
    before = _mappings_of(weights)
    gc.disable()  # no automatic collection may tidy up behind load_model's back
    try:
        quantised = load_model(tiny_dir, dtype="int8")
        assert _mappings_of(weights) == before
    finally:
        gc.enable()
    reference = quantize_linears(load_model(tiny_dir).model)
    use_layer_kernels(reference)
    use_invariant_attention(reference)
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        assert torch.equal(quantised.model(ids).logits, reference(ids).logits)


def test_gguf_is_converted_once_and_matches(tmp_path, monkeypatch):
    home = tmp_path / "home"
    source = tmp_path / "tiny-q8.gguf"
    model, stored = write_tiny_gguf(source, quantize=True)
    loaded = load_model(source, home=home)
    assert loaded.directory.parent == home / "converted"
    assert loaded.info.model_id == "tiny-q8" and loaded.info.vocab_size == 8 and loaded.info.max_context == 96
    assert loaded.info.eos_token_ids == (7,)
    # The converted weights are exactly the GGUF's (dequantised) values, in float32.
    state = loaded.model.state_dict()
    for name, values in stored.items():
        assert torch.equal(state[name], values), name
    # So the converted model computes what the HF model computes with those weights.
    model.load_state_dict(stored)
    ids = torch.tensor([[1, 2, 3, 6, 0]])
    with torch.no_grad():
        torch.testing.assert_close(
            loaded.model(input_ids=ids).logits, model(input_ids=ids).logits, atol=1e-5, rtol=0
        )
    assert loaded.tokenizer.encode("abcab") == [6, 2, 6]
    assert not [p for p in (home / "converted").iterdir() if ".tmp-" in p.name]  # no temp dirs left

    # Second load: no conversion, no re-hash (size + mtime unchanged).
    def fail(*args, **kwargs):
        raise AssertionError("must not run again")

    monkeypatch.setattr(loading, "sha256_file", fail)
    monkeypatch.setattr(loading.tempfile, "mkdtemp", fail)
    again = load_model(source, home=home)
    assert again.directory == loaded.directory
    # A directory holding exactly one .gguf resolves to that file.
    assert load_model(tmp_path, home=home).directory == loaded.directory


def test_hash_cache_notices_changes(tmp_path):
    home = tmp_path / "home"
    path = tmp_path / "blob.bin"
    path.write_bytes(b"one")
    first = cached_sha256(path, home)
    assert cached_sha256(path, home) == first
    path.write_bytes(b"two!")
    assert cached_sha256(path, home) != first


def test_missing_and_invalid_paths(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        load_model(tmp_path / "nope")
    with pytest.raises(ModelPathError, match="no config.json"):
        load_model(tmp_path)
    text = tmp_path / "weights.txt"
    text.write_text("hi")
    with pytest.raises(ModelPathError, match="weights.txt"):
        load_model(text)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf at all")
    with pytest.raises(ModelPathError, match="bad.gguf"):
        convert_gguf(bad, home=tmp_path / "home")
    assert not [p for p in (tmp_path / "home" / "converted").iterdir() if p.is_dir()]  # nothing half-written


def test_bad_options(tiny_dir):
    with pytest.raises(ValueError, match="dtype"):
        load_model(tiny_dir, dtype="int4")
    with pytest.raises(ValueError, match="CPU only"):
        load_model(tiny_dir, dtype="int8", device="cuda")
    with pytest.raises(ValueError, match="threads"):
        load_model(tiny_dir, threads=0)
    before = torch.get_num_threads()
    try:
        load_model(tiny_dir, threads=1)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


@pytest.mark.slow
def test_real_smollm2_if_installed():
    """The real 135M GGUF, only where it was installed (python -m specdec.models install smollm2-135m)."""
    from specdec.models import is_installed, resolve_model
    from specdec.runtime.kv import TreeKVCache
    from specdec.runtime.scoring import commit_path, score_tree
    from specdec.trees import DraftTree

    if not is_installed("smollm2-135m"):
        pytest.skip("smollm2-135m is not installed in the specdec home")
    loaded = load_model(resolve_model("smollm2-135m"))
    assert loaded.info.vocab_size == 49152 and loaded.info.max_context == 8192
    prompt = loaded.tokenizer.encode("def fibonacci(n):")
    kv, sequence = TreeKVCache(loaded.model), list(prompt)
    for _ in range(8):
        score = score_tree(kv, sequence, DraftTree.star([11, 12]))
        commit_path(kv, score.pending_len, [])
        sequence.append(int(torch.argmax(score.logits[0])))
    ids = torch.tensor([prompt])
    reference = loaded.model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False
    )
    assert sequence == reference[0].tolist()


def test_concurrent_conversions_run_once(tmp_path, monkeypatch):
    import threading

    home = tmp_path / "home"
    source = tmp_path / "tiny.gguf"
    write_tiny_gguf(source)
    real = loading._convert_into
    calls = []

    def counting(*args):
        calls.append(1)
        real(*args)

    monkeypatch.setattr(loading, "_convert_into", counting)
    stale = home / "converted" / f".{loading.converted_dir_for(source, home).name}.tmp-dead"
    stale.mkdir(parents=True)  # left behind by a converter that was killed
    results = []
    threads = [
        threading.Thread(target=lambda: results.append(convert_gguf(source, home=home))) for _ in range(3)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert len(results) == 3 and len(set(results)) == 1 and len(calls) == 1
    assert not stale.exists()

"""The lean forward (specdec.runtime.lean_forward): bitwise transformers' logits and cache entries
for each family it takes, float32 (sdpa, eager) and int8 (fixed-order attention, C layer kernels),
one session's tree pass, a padded batch and a ragged pass; every other model keeps its forward.
"""

from __future__ import annotations

import random

import pytest
import torch
from transformers import (
    DynamicCache,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from specdec.runtime import lean_forward
from specdec.runtime.batch_config import BatchConfig
from specdec.runtime.batching import ForwardBatcher, _Job
from specdec.runtime.kv import TreeKVCache, additive_mask
from specdec.runtime.loading import quantize_int8

VOCAB = 40
FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
}


def build(family: str, attention: str = "sdpa", seed: int = 5, **overrides) -> torch.nn.Module:
    config_class, model_class = FAMILIES[family]
    settings = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                    tie_word_embeddings=False)
    if family == "mistral":
        settings["sliding_window"] = None
    settings.update(overrides)
    config = config_class(**settings)
    config._attn_implementation = attention
    torch.manual_seed(seed)
    model = model_class(config).eval()
    with torch.no_grad():  # random biases too (Qwen2's q/k/v have them), so no term is zero
        for name, parameter in model.named_parameters():
            if name.endswith("bias"):
                parameter.normal_(0, 0.5)
    return model


MODELS = [(family, precision) for family in FAMILIES for precision in ("sdpa", "eager", "int8")]


@pytest.fixture(scope="module", params=MODELS, ids=[f"{f}-{p}" for f, p in MODELS])
def model(request):
    family, precision = request.param
    model = build(family, "eager" if precision == "eager" else "sdpa")
    return quantize_int8(model) if precision == "int8" else model


def tree_pass_inputs(batch: int, cached: list[int], new: int, seed: int):
    """Left-padded rows of `new` entries after `cached` prefix entries each, a random tree's mask."""
    rng = random.Random(seed)
    longest = max(cached)
    allowed = torch.zeros((batch, new, longest + new), dtype=torch.bool)
    positions = torch.zeros((batch, new), dtype=torch.long)
    for b, length in enumerate(cached):
        allowed[b, :, longest - length:longest] = True
        depth = [0] * new
        for j in range(new):
            parent = rng.randrange(-1, j)
            allowed[b, j, longest + j] = True
            if parent >= 0:
                allowed[b, j, longest:longest + new] |= allowed[b, parent, longest:longest + new]
            depth[j] = 1 if parent < 0 else depth[parent] + 1
            positions[b, j] = length + depth[j] - 1
    tokens = torch.tensor([[rng.randrange(VOCAB) for _ in range(new)] for _ in range(batch)])
    return tokens, positions, allowed


def prefilled(model, batch: int, cached: list[int], seed: int) -> DynamicCache:
    """A cache holding each row's `cached` prefix, left-padded to the longest (padding sees itself)."""
    rng = random.Random(seed)
    longest = max(cached)
    cache = DynamicCache(config=model.config)
    allowed = torch.zeros((batch, longest, longest), dtype=torch.bool)
    allowed[:, torch.arange(longest), torch.arange(longest)] = True
    positions = torch.zeros((batch, longest), dtype=torch.long)
    for b, length in enumerate(cached):
        start = longest - length
        allowed[b, start:, start:] = torch.ones((length, length), dtype=torch.bool).tril()
        positions[b, start:] = torch.arange(length)
    tokens = torch.tensor([[rng.randrange(VOCAB) for _ in range(longest)] for _ in range(batch)])
    dtype = next(model.parameters()).dtype
    model(input_ids=tokens, attention_mask=additive_mask(allowed, dtype)[:, None], position_ids=positions,
          past_key_values=cache, use_cache=True)
    return cache


@pytest.mark.parametrize("batch, cached, new, keep", [(1, [7], 5, 5), (1, [1], 1, 1), (3, [9, 2, 5], 4, 2),
                                                     (2, [3, 6], 6, 0)])
def test_lean_logits_and_cache_entries_are_transformers_bitwise(model, batch, cached, new, keep):
    assert lean_forward.supports(model)
    dtype = next(model.parameters()).dtype
    tokens, positions, allowed = tree_pass_inputs(batch, cached, new, seed=new + batch)
    mask = additive_mask(allowed, dtype)[:, None]
    with torch.inference_mode():
        theirs_cache, lean_cache = prefilled(model, batch, cached, 1), prefilled(model, batch, cached, 1)
        theirs = model(input_ids=tokens, attention_mask=mask, position_ids=positions,
                       past_key_values=theirs_cache, use_cache=True, logits_to_keep=keep).logits
        lean = lean_forward.lean_logits(model, tokens, mask, positions, lean_cache, keep)
    assert lean.shape == theirs.shape == (batch, keep or new, VOCAB)
    assert torch.equal(lean, theirs)
    for ours, reference in zip(lean_cache.layers, theirs_cache.layers, strict=True):
        assert torch.equal(ours.keys, reference.keys) and torch.equal(ours.values, reference.values)


def test_a_tree_kv_cache_runs_the_lean_pass_and_transformers_forward_only_when_switched_off(monkeypatch):
    """The session cache's pass goes around `model.forward` (which here fails) unless
    SPECDEC_LEAN_FORWARD=0; the rows are the same either way."""
    model = quantize_int8(build("qwen2"))
    rows = {}
    for switch in ("1", "0"):
        monkeypatch.setenv(lean_forward.ENV, switch)
        kv = TreeKVCache(model)
        with torch.inference_mode():
            kv.extend_chain([3, 1, 4, 1, 5])
            rows[switch] = kv.extend([9, 2, 6], [-1, 0, 0], 0)
    assert torch.equal(rows["1"], rows["0"])

    def refuse(*args, **kwargs):
        raise AssertionError("transformers' forward ran")

    monkeypatch.setattr(model, "forward", refuse)
    monkeypatch.setenv(lean_forward.ENV, "1")
    with torch.inference_mode():
        TreeKVCache(model).extend_chain([3, 1, 4])
    monkeypatch.setenv(lean_forward.ENV, "0")
    with pytest.raises(AssertionError, match="transformers' forward ran"), torch.inference_mode():
        TreeKVCache(model).extend_chain([3, 1, 4])


def test_a_ragged_pass_is_the_same_lean_or_not(monkeypatch):
    """Three sessions in one ragged pass (the attention reads each one's own mask through the
    keyword the lean pass hands on): rows bitwise equal with and without the lean forward."""
    model = quantize_int8(build("qwen3"))
    batcher = ForwardBatcher(model, BatchConfig(window_ms=0))
    assert batcher.joins_prefill
    rows = {}
    for switch in ("1", "0"):
        monkeypatch.setenv(lean_forward.ENV, switch)
        sessions = [TreeKVCache(model, runner=batcher) for _ in range(3)]
        with torch.inference_mode():
            for kv, prompt in zip(sessions, ([1, 2, 3], [4] * 9, [7]), strict=True):
                kv.extend_chain(prompt)
            jobs = [_Job(kv=kv, plan=kv.plan(tokens, parents, 0))
                    for kv, (tokens, parents) in zip(sessions, (([5, 6], [-1, 0]), ([8], [-1]),
                                                                ([2, 2, 2], [-1, 0, 0])), strict=True)]
            batcher._execute(jobs)
        assert all(job.error is None for job in jobs)
        rows[switch] = [job.logits for job in jobs]
    assert all(torch.equal(a, b) for a, b in zip(rows["1"], rows["0"], strict=True))


def test_models_it_does_not_know_keep_their_forward(monkeypatch):
    assert lean_forward.supports(build("qwen2"))
    sliding = build("qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=0)
    assert "sliding_attention" in sliding.config.layer_types and not lean_forward.supports(sliding)
    assert not lean_forward.supports(build("mistral", sliding_window=8))
    training = build("llama").train()
    assert not lean_forward.supports(training)
    hooked = build("llama")
    hooked.model.register_forward_hook(lambda *args: None)
    assert not lean_forward.supports(hooked)
    from transformers import GPT2Config, GPT2LMHeadModel

    assert not lean_forward.supports(GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=16, n_layer=1,
                                                                n_head=2)))
    monkeypatch.setenv(lean_forward.ENV, "0")
    assert not lean_forward.supports(build("qwen2"))


def test_the_fallback_is_transformers_forward(monkeypatch):
    """`causal_lm_logits` on a model the lean pass does not take equals the model's own call."""
    model = build("qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=0)
    tokens, positions, allowed = tree_pass_inputs(1, [1], 3, seed=2)
    mask = additive_mask(allowed, torch.float32)[:, None]
    with torch.inference_mode():
        cache_a, cache_b = prefilled(model, 1, [1], 0), prefilled(model, 1, [1], 0)
        expected = model(input_ids=tokens, attention_mask=mask, position_ids=positions,
                         past_key_values=cache_a, use_cache=True, logits_to_keep=2).logits
        got = lean_forward.causal_lm_logits(model, tokens, mask, positions, cache_b, 2)
    assert torch.equal(got, expected)


def test_a_hook_added_later_sends_the_passes_through_transformers_forward():
    """Support is cached per model, hooks are not: a forward hook registered after the first pass
    (as a test counting passes does) sees every later pass."""
    model = build("llama")
    assert lean_forward.supports(model)
    passes = []
    hook = model.register_forward_hook(lambda *_: passes.append(1))
    try:
        with torch.inference_mode():
            TreeKVCache(model).extend_chain([1, 2, 3])
    finally:
        hook.remove()
    assert passes == [1] and lean_forward.supports(model)

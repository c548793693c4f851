"""A causal LM's logits without transformers' wrappers: the same modules, called in the same order.

A pass through `model(...)` runs, besides the layers, transformers' decorators (argument merging,
output capture, deprecated-keyword checks on the model and on each of its layers), the mask
builder (which hands a ready 4D mask back unchanged) and output classes. On the default target
that is 1.4–3.3 ms of a 60–75 ms decode pass on a 2-vCPU CPU (bench/RESULTS.md, "The lean
forward"); HF's own `generate` pays it. `lean_logits` calls the embedding, the rotary table, per
layer the norms, projections, rotary, cache update, attention function and MLP, the final norm and
the vocabulary rows, with the same arguments transformers passes them, so the logits are bitwise
the same (tests/runtime/test_lean_forward.py checks each supported family, int8 included).

Only families whose layers are exactly that computation qualify (`supports`): Llama, Mistral,
Qwen2 and Qwen3 (its per-head q/k norms included) with full attention in every layer, no hooks on
the outer modules and no training mode. Everything else, and every model with SPECDEC_LEAN_FORWARD=0,
runs transformers' forward.
"""

from __future__ import annotations

import functools
import inspect
import sys
import weakref
from typing import Any

import torch

from specdec.defaults import switched_off

ENV = "SPECDEC_LEAN_FORWARD"
# The causal-LM classes whose decoder layers are exactly pre-norm attention + pre-norm MLP
# (specdec.runtime.layer_kernels swaps their norms and MLPs; the lean pass calls whatever is there).
FAMILIES = {
    "LlamaForCausalLM": "LlamaDecoderLayer",
    "MistralForCausalLM": "MistralDecoderLayer",
    "Qwen2ForCausalLM": "Qwen2DecoderLayer",
    "Qwen3ForCausalLM": "Qwen3DecoderLayer",
}

_support: weakref.WeakKeyDictionary[torch.nn.Module, bool] = weakref.WeakKeyDictionary()


def enabled() -> bool:
    return not switched_off(ENV)


def _hooked(module: torch.nn.Module) -> bool:
    """Hooks on the modules the lean pass does not call through (accelerate's device hooks too)."""
    return bool(module._forward_hooks or module._forward_pre_hooks or hasattr(module, "_hf_hook"))


def _check(model: torch.nn.Module) -> bool:
    layer_class = FAMILIES.get(type(model).__name__)
    inner = getattr(model, "model", None)
    config = getattr(model, "config", None)
    if layer_class is None or inner is None or config is None:
        return False
    layers = list(inner.layers[: config.num_hidden_layers])
    if not layers or any(type(layer).__name__ != layer_class for layer in layers):
        return False
    if any(layer_type != "full_attention" for layer_type in getattr(config, "layer_types", None) or ()):
        return False
    if getattr(config, "sliding_window", None) is not None and type(model).__name__ == "MistralForCausalLM":
        return False  # Mistral passes its config's window to attention and masks by it
    return all(getattr(layer.self_attn, "sliding_window", None) is None for layer in layers)


def supports(model: torch.nn.Module) -> bool:
    """Whether `lean_logits` computes `model`'s own logits: the family and its layers checked once
    per model; training mode and hooks (a test counting passes, accelerate's) every call."""
    if not enabled() or model.training or _hooked(model) or _hooked(getattr(model, "model", model)):
        return False
    known = _support.get(model)
    if known is None:
        known = _support[model] = _check(model)
    return known


def lean_logits(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                position_ids: torch.Tensor, cache: Any, logits_to_keep: int | torch.Tensor,
                **attention_kwargs: Any) -> torch.Tensor:
    """`model(input_ids, attention_mask=4D mask, position_ids, past_key_values=cache,
    use_cache=cache is not None, logits_to_keep, **attention_kwargs).logits` for a model that
    `supports` accepts. `attention_kwargs` reach the attention function as in transformers."""
    inner = model.model
    config = model.config
    use_cache = cache is not None
    hidden = inner.embed_tokens(input_ids)
    position_embeddings = inner.rotary_emb(hidden, position_ids)
    cos, sin = position_embeddings
    shape = hidden.shape[:-1]
    # transformers' layers pass these on to the attention function in their **kwargs
    passed = {"position_ids": position_ids, "use_cache": use_cache, **attention_kwargs}
    # the other families name their (absent) window to the attention function
    window = {} if type(model).__name__ == "LlamaForCausalLM" else {"sliding_window": None}
    layers = inner.layers[: config.num_hidden_layers]
    family = sys.modules[type(layers[0].self_attn).__module__]
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # heavy: not on a client's import

    attention = ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation,
                                                      family.eager_attention_forward)
    for layer in layers:
        block = layer.self_attn
        heads = (*shape, -1, block.head_dim)
        x = layer.input_layernorm(hidden)
        query = block.q_proj(x).view(heads)
        key = block.k_proj(x).view(heads)
        if hasattr(block, "q_norm"):  # Qwen3's per-head norms, before the transpose
            query, key = block.q_norm(query), block.k_norm(key)
        query, key = query.transpose(1, 2), key.transpose(1, 2)
        value = block.v_proj(x).view(heads).transpose(1, 2)
        query, key = family.apply_rotary_pos_emb(query, key, cos, sin)
        if use_cache:
            key, value = cache.update(key, value, block.layer_idx, kwargs=passed)
        out, _ = attention(block, query, key, value, attention_mask, dropout=0.0, scaling=block.scaling,
                           **window, **passed)
        hidden = hidden + block.o_proj(out.reshape(*shape, -1).contiguous())
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
    hidden = inner.norm(hidden)
    if isinstance(logits_to_keep, int):
        logits_to_keep = slice(-logits_to_keep, None)
    return model.lm_head(hidden[:, logits_to_keep, :])


def causal_lm_logits(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                     position_ids: torch.Tensor, cache: Any, logits_to_keep: int | torch.Tensor,
                     **attention_kwargs: Any) -> torch.Tensor:
    """The logits of one pass with a ready 4D additive mask: lean where `supports` says so, else
    through the model's own forward."""
    if supports(model):
        return lean_logits(model, input_ids, attention_mask, position_ids, cache, logits_to_keep,
                           **attention_kwargs)
    return model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                 use_cache=cache is not None, logits_to_keep=logits_to_keep,
                 **{_cache_keyword(_function(model.forward)): cache}, **attention_kwargs).logits


def _function(method: Any) -> Any:
    """The function behind a bound method (the same for every instance: what the cache below keys)."""
    return getattr(method, "__func__", method)


@functools.cache
def _cache_keyword(forward: Any) -> str:
    """transformers renamed the forward's `past_key_values` to `cache` (5.2x); the one it takes."""
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"

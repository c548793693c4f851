"""Model shapes of the device check, written out as config dicts (no download), and how the check
builds a model with random weights straight on the device and wraps it as the engines expect.

The real shapes are those of the published checkpoints (config.json of Qwen2.5-0.5B/1.5B/7B and
Llama-3.2-1B / Llama-3.1-8B); the weights are random, which changes no timing. The tiny shapes are
for the CPU dry run. A model built twice with one seed has the same weights (draft = target runs).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

QWEN_COMMON = {
    "model_type": "qwen2",
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "max_position_embeddings": 32768,
    "bos_token_id": 151643,
    "eos_token_id": 151643,
    "use_sliding_window": False,
    "attention_dropout": 0.0,
}
LLAMA_COMMON = {
    "model_type": "llama",
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "max_position_embeddings": 131072,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "vocab_size": 128256,
    "head_dim": 64,
    "attention_bias": False,
    "mlp_bias": False,
}

CONFIGS: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": {
        **QWEN_COMMON,
        "vocab_size": 151936,
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "tie_word_embeddings": True,
    },
    "qwen2.5-1.5b": {
        **QWEN_COMMON,
        "vocab_size": 151936,
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "tie_word_embeddings": True,
    },
    "qwen2.5-7b": {
        **QWEN_COMMON,
        "vocab_size": 152064,
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "tie_word_embeddings": False,
    },
    "llama-3.2-1b": {
        **LLAMA_COMMON,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "tie_word_embeddings": True,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    },
    "llama-3.1-8b": {
        **LLAMA_COMMON,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "tie_word_embeddings": False,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    },
    # The dry run's stand-ins: the same code paths, shapes a 2-core CPU runs in milliseconds.
    "tiny-draft": {
        **QWEN_COMMON,
        "vocab_size": 512,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "max_position_embeddings": 2048,
        "bos_token_id": 0,
        "eos_token_id": 511,
        "tie_word_embeddings": False,
    },
    "tiny-target": {
        **QWEN_COMMON,
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 2048,
        "bos_token_id": 0,
        "eos_token_id": 511,
        "tie_word_embeddings": False,
    },
}
# Timed models (the default pair's shapes first, so a step cut short by its budget has what the
# projection needs most), and
# the (draft, target) pairs the projection is made for.
REAL_MODELS = ("qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-7b", "llama-3.2-1b", "llama-3.1-8b")
TINY_MODELS = ("tiny-draft", "tiny-target")
REAL_PAIRS = (
    ("qwen2.5-0.5b", "qwen2.5-1.5b"),
    ("qwen2.5-0.5b", "qwen2.5-7b"),
    ("llama-3.2-1b", "llama-3.1-8b"),
)
TINY_PAIRS = (("tiny-draft", "tiny-target"),)
# Draft = target in the overhead step (acceptance 1 by construction).
REAL_SELF_PAIR_MODEL = "qwen2.5-1.5b"
TINY_SELF_PAIR_MODEL = "tiny-target"


def config_of(name: str, vocab_size: int | None = None):
    """The transformers config object of shape `name` (sdpa attention: it honours our 4D masks);
    `vocab_size` overrides the shape's (a draft shape paired with a target of a padded vocabulary)."""
    from transformers import AutoConfig

    values = dict(CONFIGS[name])
    if vocab_size is not None:
        values["vocab_size"] = vocab_size
    config = AutoConfig.for_model(values.pop("model_type"), **values)
    config._attn_implementation = "sdpa"
    return config


def build_model(name: str, device: str, dtype: str, seed: int = 0, vocab_size: int | None = None,
                keep_layers: int | None = None, damp: tuple[int, float] | None = None):
    """Random weights of shape `name`, created on `device` in `dtype` (no host copy of a 16 GB model).

    `damp` = (n, s): the output projections (attention's o_proj, the MLP's down_proj) of every layer
    from n on are scaled by s, so those layers add little to the residual stream and the shape's own
    first n layers (keep_layers=n, same seed) agree with it about as much as a real draft does. The
    pass costs what it cost: the same shapes, the same kernels."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    if device.startswith("cuda"):
        torch.cuda.manual_seed_all(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config_of(name, vocab_size), dtype=getattr(torch, dtype))
    if damp is not None:
        first, scale = damp
        with torch.no_grad():
            for layer in model.model.layers[first:]:
                layer.self_attn.o_proj.weight.mul_(scale)
                layer.mlp.down_proj.weight.mul_(scale)
    if keep_layers is not None:  # a self-draft: the shape's own first layers, embeddings and head
        model.model.layers = model.model.layers[:keep_layers]
        model.config.num_hidden_layers = keep_layers
        if getattr(model.config, "layer_types", None):
            model.config.layer_types = model.config.layer_types[:keep_layers]
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    return model.eval()


def loaded_model(name: str, device: str, dtype: str, seed: int = 0, tokenizer: Any = None,
                 vocab_size: int | None = None, keep_layers: int | None = None,
                 damp: tuple[int, float] | None = None):
    """The engines' LoadedModel for a random model of shape `name`, with `tokenizer` or else a
    word-level tokenizer of its vocabulary (specdec.runtime.tiny's "t{i}" words; seconds to build for
    150k words, so a caller that builds several models of one vocabulary passes one along), as
    specdec.runtime.loading would return it."""
    from specdec.engine.api import ModelInfo
    from specdec.runtime.loading import LoadedModel
    from specdec.runtime.tiny import build_tokenizer

    model = build_model(name, device, dtype, seed, vocab_size, keep_layers, damp)
    vocab = int(model.get_output_embeddings().weight.shape[0])
    damped = f"-damped{damp[0]}x{damp[1]:g}" if damp else ""
    info = ModelInfo(
        model_id=f"{name}{f'[:{keep_layers}]' if keep_layers else ''}{damped}-random-{seed}@{dtype}",
        vocab_size=vocab,
        tokenizer_fingerprint=f"words-{vocab}",
        max_context=4096,
        eos_token_ids=(vocab - 1,),
        device=device,
        dtype=dtype,
    )
    tokenizer = tokenizer if tokenizer is not None else build_tokenizer(vocab)
    return LoadedModel(model=model, tokenizer=tokenizer, info=info, directory=Path("."))


def parameters_b(model) -> float:
    """Parameters in billions (tied embeddings counted once)."""
    return sum(p.numel() for p in model.parameters()) / 1e9

"""Tiny random causal LMs built from a config: small enough to enumerate every continuation.

Used by the fidelity, cache and integration tests and by the analyser/bench smoke runs; they
need no download. A word-level tokenizer maps token i to the word "t{i}" so text prompts work.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch


def build_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="t0", eos_token=f"t{vocab_size - 1}")


def build_tiny_model(vocab_size: int = 6, seed: int = 0, hidden_size: int = 16, num_layers: int = 2,
                     max_position_embeddings: int = 128, logit_scale: float = 4.0):
    """A random Qwen2-architecture model; `logit_scale` spreads the next-token distributions."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=False,
        eos_token_id=vocab_size - 1,
        bos_token_id=0,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(logit_scale)
    return model.eval()


def save_tiny_model(directory: str | Path, vocab_size: int = 6, seed: int = 0, **kwargs) -> Path:
    """Write a tiny model + tokenizer as a normal local HF directory and return its path."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    build_tiny_model(vocab_size=vocab_size, seed=seed, **kwargs).save_pretrained(directory)
    build_tokenizer(vocab_size).save_pretrained(directory)
    # AutoTokenizer would otherwise pick the architecture's own tokenizer class (Qwen2's BPE).
    config_path = directory / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text())
    tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(tokenizer_config, indent=2))
    return directory

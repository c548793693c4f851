"""Tiny BPE tokenizers of the kinds real models use (byte-level like GPT-2 / Qwen, byte fallback like
Llama 2), trained or built here in milliseconds, and a tiny model directory around one: the tiny
word-level tokenizers of specdec.runtime.tiny drop whitespace, so no text bound holds for them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# Repeats make long merges (the longest token is a run of "="), accents and CJK give multi-byte ones.
CORPUS = [
    "the quick brown fox jumps over the lazy dog. " * 8,
    "def f(x):\n    return x + 1\n" * 8,
    "=" * 48 + "\n" + "café naïve résumé 東京 ünïcödé " * 4,
]


def byte_level_tokenizer(normalizer: Any = None, vocab_size: int = 320) -> Any:
    """A trained byte-level BPE (GPT-2 / Qwen style) as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    if normalizer is not None:
        backend.normalizer = normalizer
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<eos>"], show_progress=False)
    backend.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>")


def byte_fallback_tokenizer() -> Any:
    """A BPE with byte fallback and Metaspace (Llama 2 / Mistral style), built by hand."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}}
    for piece in ["▁", "a", "b", "c", "▁a", "▁ab", "▁abc"]:
        vocab[piece] = len(vocab)
    merges = [("▁", "a"), ("▁a", "b"), ("▁ab", "c")]
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")


def save_byte_level_model(directory: Path, max_context: int = 64) -> Path:
    """A tiny random model with a byte-level BPE tokenizer, as a local model directory."""
    from specdec.runtime.tiny import build_tiny_model

    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = byte_level_tokenizer()
    model = build_tiny_model(vocab_size=len(tokenizer), max_position_embeddings=max_context)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"  # not the architecture's own (Qwen2) class
    config_path.write_text(json.dumps(config, indent=2))
    return directory

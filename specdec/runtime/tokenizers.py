"""Loading a tokenizer from a local model directory, and its fingerprint."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path


def load_tokenizer(directory: str | Path):
    """AutoTokenizer, except where tokenizer_config.json names PreTrainedTokenizerFast.

    transformers 5 picks the architecture's tokenizer class from config.json even when the
    directory's tokenizer_config asks for the generic fast tokenizer (our tiny word-level test
    models), which would silently tokenize everything to nothing.
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    directory = Path(directory)
    config_path = directory / "tokenizer_config.json"
    if config_path.exists():
        if json.loads(config_path.read_text()).get("tokenizer_class") == "PreTrainedTokenizerFast":
            return PreTrainedTokenizerFast.from_pretrained(str(directory), local_files_only=True)
    return AutoTokenizer.from_pretrained(str(directory), local_files_only=True)


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 over the id → token-string table and the special tokens.

    Two tokenizers with the same fingerprint map ids to the same strings, which is what the
    drafter/verifier pairing needs (the models must agree on what token id i means).
    """
    vocab = tokenizer.get_vocab()
    table = sorted(vocab.items(), key=lambda item: item[1])
    payload = json.dumps({"vocab": table, "special": sorted(map(str, tokenizer.all_special_tokens))})
    return hashlib.sha256(payload.encode()).hexdigest()

"""At most how many bytes of text one token stands for: lets the verifier refuse a text that cannot
fit its context window before spending time tokenizing it.

A text of B UTF-8 bytes gives at least B / (S × L) tokens when every byte of it ends up in some
token (nothing dropped, nothing folded into an unknown token), L is the most bytes one token covers
and S bounds how much normalisation can shrink the text. That holds for byte-level BPE (GPT-2,
Qwen, Llama 3: each character of a token is one byte of text) and BPE with byte fallback (Llama 2,
Mistral: a token's string is at least as long as the text it covers), with at most these
normalisers: NFC/NFD/NFKC/NFKD and lowercasing shrink UTF-8 text by at most 4× (U+107A5, 4 bytes,
becomes a 1-byte letter under NFKC; U+0390 NFD, 6 bytes, composes to 2), Prepend only grows it,
and a string Replace by at most |pattern| / |content|.

Elsewhere the bound is None (no context check before tokenizing; the orchestrator's byte limit
still applies): whitespace-dropping pre-tokenizers (Whitespace, BERT), models with an unknown
token (WordLevel, WordPiece, Unigram, BPE without byte fallback), normalisers that strip or remove
characters, added tokens that absorb neighbouring whitespace (lstrip / rstrip), slow tokenizers.
"""

from __future__ import annotations

import json
import logging
import math
from typing import Any

log = logging.getLogger(__name__)

MAX_NORMALIZATION_SHRINK = 4  # Unicode normal forms and lowercasing, in UTF-8 bytes (see above)
_SHRINKING = {"NFC", "NFD", "NFKC", "NFKD", "Lowercase"}
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "UnicodeScripts"}
_SPLITTING_PRE_TOKENIZERS = {"Split", "Punctuation"}  # keep the input unless behavior is "Removed"


def max_bytes_per_token(tokenizer: Any) -> int | None:
    """S × L for `tokenizer` (a transformers fast tokenizer), or None where no such bound holds.

    Reads the vocabulary once: about 0.1 s for a 151k-token vocabulary.
    """
    try:
        return _bound(tokenizer)
    except Exception as exc:  # noqa: BLE001 - an unusual tokenizer gets no bound rather than a failure
        log.debug("no bytes-per-token bound for %s: %s", type(tokenizer).__name__, exc)
        return None


def _bound(tokenizer: Any) -> int | None:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not getattr(tokenizer, "is_fast", False):
        return None
    model = backend.model
    if type(model).__name__ != "BPE":
        return None
    pre = _state(backend.pre_tokenizer)
    byte_level = _has_type(pre, "ByteLevel")
    if not (byte_level or getattr(model, "byte_fallback", False)) or not _keeps_input(pre):
        return None
    shrink = _shrink(_state(backend.normalizer))
    if shrink is None:
        return None
    added = list(backend.get_added_tokens_decoder().values())
    if any(token.lstrip or token.rstrip for token in added):
        return None
    vocab = backend.get_vocab(with_added_tokens=False)
    if byte_level:
        # Each character of the byte-level alphabet is one byte of text; any other character
        # (a token only an added-token match can give) counts its own UTF-8 length.
        from tokenizers import pre_tokenizers

        alphabet = frozenset(pre_tokenizers.ByteLevel.alphabet())
        longest = max((len(s) if alphabet.issuperset(s) else len(s.encode()) for s in vocab), default=1)
    else:
        longest = max((len(s.encode()) for s in vocab), default=1)
    longest = max([longest, 1, *(len(token.content.encode()) for token in added)])
    return shrink * longest


def _state(component: Any) -> dict[str, Any] | None:
    """A normaliser's or pre-tokenizer's JSON description (small: no vocabulary)."""
    return None if component is None else json.loads(component.__getstate__())


def _parts(state: dict[str, Any], key: str) -> list[dict[str, Any]]:
    return state[key] if state.get("type") == "Sequence" else [state]


def _has_type(state: dict[str, Any] | None, name: str) -> bool:
    return state is not None and any(part.get("type") == name for part in _parts(state, "pretokenizers"))


def _keeps_input(state: dict[str, Any] | None) -> bool:
    """Whether the pre-tokenizer hands every character on (splits, never drops)."""
    if state is None:
        return True
    for part in _parts(state, "pretokenizers"):
        kind = part.get("type")
        if kind in _SPLITTING_PRE_TOKENIZERS:
            if part.get("behavior") == "Removed":
                return False
        elif kind not in _KEEPING_PRE_TOKENIZERS:
            return False
    return True


def _shrink(state: dict[str, Any] | None) -> int | None:
    """How many times shorter (UTF-8 bytes) normalisation can make a text; None: unbounded/unknown."""
    if state is None:
        return 1
    factor = 1
    for part in _parts(state, "normalizers"):
        kind = part.get("type")
        if kind in _SHRINKING:
            factor *= MAX_NORMALIZATION_SHRINK
        elif kind in ("Prepend", "ByteLevel"):  # only add bytes
            continue
        elif kind == "Replace" and "String" in part.get("pattern", {}) and part.get("content"):
            pattern, content = part["pattern"]["String"].encode(), part["content"].encode()
            factor *= max(1, math.ceil(len(pattern) / len(content)))
        else:  # Strip, StripAccents, BertNormalizer, Precompiled, Nmt, a regex Replace, …
            return None
    return factor

"""The bytes-per-token bound (specdec.runtime.text_bounds): a true bound where it is given, and none
where a tokenizer can swallow text (whitespace dropped, unknown tokens, stripping normalisers)."""

from __future__ import annotations

import unicodedata

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from specdec.runtime.text_bounds import MAX_NORMALIZATION_SHRINK, max_bytes_per_token
from specdec.runtime.tiny import build_tokenizer
from tests.bpe_helpers import CORPUS, byte_fallback_tokenizer, byte_level_tokenizer

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# Text that merges well, text that does not, and text NFC/NFKC shrink (decomposed accents, Hangul
# jamo, compatibility characters: 48 fullwidth "=" are 144 bytes that NFKC makes 3 tokens of 16).
TEXTS = st.one_of(
    st.text(max_size=200),
    st.lists(st.sampled_from(list("=ab \n東é") + ["e\u0301", "\u1100\u1161\u11a8", "\U0001d400", "\uff1d"]),
             max_size=100).map("".join),
    st.sampled_from(CORPUS),
)


@pytest.fixture(scope="module")
def tokenizers():
    from tokenizers import normalizers

    return {
        "byte-level": byte_level_tokenizer(),
        "byte-level+NFKC": byte_level_tokenizer(normalizers.NFKC()),
        "byte-level+NFD+Lowercase": byte_level_tokenizer(normalizers.Sequence([normalizers.NFD(),
                                                                               normalizers.Lowercase()])),
        "byte-fallback": byte_fallback_tokenizer(),
    }


def test_byte_level_bound_is_the_longest_token_in_bytes(tokenizers) -> None:
    tokenizer = tokenizers["byte-level"]
    longest = max(len(token) for token in tokenizer.backend_tokenizer.get_vocab(with_added_tokens=False))
    assert max_bytes_per_token(tokenizer) == longest == 16  # "=" * 16: one character is one byte
    assert max_bytes_per_token(tokenizers["byte-level+NFKC"]) == MAX_NORMALIZATION_SHRINK * longest
    shrink = MAX_NORMALIZATION_SHRINK
    assert max_bytes_per_token(tokenizers["byte-level+NFD+Lowercase"]) == shrink * shrink * longest
    assert max_bytes_per_token(tokenizers["byte-fallback"]) == len("<0x00>")


@SETTINGS
@given(text=TEXTS, name=st.sampled_from(["byte-level", "byte-level+NFKC", "byte-level+NFD+Lowercase",
                                         "byte-fallback"]))
@example(text="\uff1d" * 48, name="byte-level+NFKC")  # 144 bytes, 3 tokens: needs the NFKC factor
@example(text="=" * 4096, name="byte-level")
@example(text="東京" * 50, name="byte-fallback")
def test_the_bound_holds(tokenizers, text, name) -> None:
    """No text has more UTF-8 bytes than its token count times the bound."""
    tokenizer = tokenizers[name]
    bound = max_bytes_per_token(tokenizer)
    tokens = len(tokenizer.encode(text, add_special_tokens=True))
    assert len(text.encode()) <= tokens * bound


def test_normalisation_shrinks_utf8_by_at_most_the_stated_factor() -> None:
    """The factor the bound uses for NF* forms and lowercasing, checked over every code point."""
    worst = 1.0
    for cp in range(0x110000):
        if 0xD800 <= cp <= 0xDFFF:
            continue
        char = chr(cp)
        for source in {char, unicodedata.normalize("NFD", char)}:
            for out in [unicodedata.normalize(form, source) for form in ("NFC", "NFD", "NFKC", "NFKD")]:
                worst = max(worst, len(source.encode()) / len(out.encode()))
            worst = max(worst, len(source.encode()) / max(1, len(source.lower().encode())))
    assert worst <= MAX_NORMALIZATION_SHRINK


def test_no_bound_where_the_tokenizer_can_swallow_text() -> None:
    from tokenizers import AddedToken, normalizers, pre_tokenizers

    # The tiny word-level test tokenizer drops whitespace and maps unknown words to one token.
    word_level = build_tokenizer(8)
    assert max_bytes_per_token(word_level) is None
    assert len(word_level.encode("t1" + " " * 10_000 + "t2")) == 2  # why: 10 kB of text, two tokens

    whitespace = byte_level_tokenizer()
    whitespace.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Whitespace(), pre_tokenizers.ByteLevel(add_prefix_space=False)])
    assert max_bytes_per_token(whitespace) is None

    stripping = byte_level_tokenizer(normalizers.Sequence([normalizers.NFC(), normalizers.Strip()]))
    assert max_bytes_per_token(stripping) is None

    absorbing = byte_level_tokenizer()
    absorbing.add_special_tokens({"additional_special_tokens": [AddedToken("<mask>", lstrip=True)]})
    assert max_bytes_per_token(absorbing) is None

    class Slow:  # a tokenizer without a Rust backend
        is_fast = False

    assert max_bytes_per_token(Slow()) is None
    assert max_bytes_per_token(object()) is None

"""Incremental detokenization (specdec.runtime.detokenize): at every token boundary the settled text,
the new pieces and the last tail are exactly the one-shot decode of the output, special tokens give
no text, and the window falls back to decoding from the output's start when it cannot be trusted."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from specdec.defaults import specdec_home
from specdec.engine.api import TextCursor
from specdec.runtime.detokenize import PARTIAL, TextStep, check_cursor, detokenize
from tests.bpe_helpers import byte_level_tokenizer

QWEN_SHA = "1d9614638d18024d0fbb36575a15f130"  # Qwen2.5-Coder 0.5B's converted directory (byte-level BPE)
TEXT = "Yes: 東京は晴れ 🎉👩‍💻 café naïve — ünïcödé ok\n日本語のテキスト 😀 end"


def one_shot(tokenizer) -> Callable[[Sequence[int]], str]:
    """The text contract's decode (VerifyOutcome's doc)."""
    return lambda ids: tokenizer.decode(list(ids), skip_special_tokens=True,
                                        clean_up_tokenization_spaces=False)


def run_steps(decode, ids: list[int], start: int, chunks: list[int]) -> tuple[str, list[TextStep]]:
    """Feed ids[start:] in `chunks` as successive verifies would, checking the contract at every
    token; returns the caller's settled text at the end and the steps."""
    cursor, settled, end, steps = TextCursor(start, start, start), "", start, []
    for size in chunks:
        step = detokenize(decode, ids[: end + size], cursor, size)
        assert len(step.pieces) == len(step.tails) == size
        for n in range(1, size + 1):
            shown = settled + "".join(step.pieces[:n]) + step.tails[n - 1]
            assert shown == decode(ids[start: end + n]), (end + n, step.pieces, step.tails)
        settled += "".join(step.pieces)
        end += size
        cursor = step.cursor
        assert cursor.start == start and start <= cursor.prefix <= cursor.read <= end
        steps.append(step)
    return settled, steps


def random_chunks(total: int, rng: random.Random, most: int = 5) -> list[int]:
    chunks = []
    while total > 0:
        chunks.append(min(total, rng.randint(1, most)))
        total -= chunks[-1]
    return chunks


@pytest.fixture(scope="module")
def tiny_bpe():
    """A byte-level BPE trained here (GPT-2 / Qwen style) with an <eos> special token."""
    return byte_level_tokenizer()


@pytest.fixture(scope="module")
def qwen():
    directory = Path(specdec_home()) / "converted" / QWEN_SHA
    if not (directory / "tokenizer.json").exists():
        pytest.skip(f"the Qwen2.5-Coder tokenizer is not installed ({directory})")
    from specdec.runtime.tokenizers import load_tokenizer

    return load_tokenizer(directory)


@pytest.fixture(params=["tiny_bpe", "qwen"])
def tokenizer(request):
    return request.getfixturevalue(request.param)


# --------------------------------------------------------------------------- (a) multi-byte text


@pytest.mark.parametrize("seed", range(4))
def test_multi_byte_text_in_random_chunks(tokenizer, seed) -> None:
    rng = random.Random(seed)
    prompt = tokenizer.encode("Say it:", add_special_tokens=False)
    out = tokenizer.encode(TEXT, add_special_tokens=False)
    ids = prompt + out
    decode = one_shot(tokenizer)
    settled, steps = run_steps(decode, ids, len(prompt), random_chunks(len(out), rng))
    assert settled == TEXT  # the text ends on a whole character: everything is settled
    tails = [t for s in steps for t in s.tails]
    assert any(t.endswith(PARTIAL) for t in tails)  # partial characters were met on the way
    assert sum(s.fallbacks for s in steps) == 0
    # Windows stay short: no decode spans the whole output.
    assert max(n for s in steps for n in s.decoded) < len(out) // 2


@pytest.mark.parametrize("seed", range(3))
def test_random_tokens_one_at_a_time_and_in_chunks(tokenizer, seed) -> None:
    """Random ids (byte tokens, stray continuation bytes, specials) decode exactly at every boundary."""
    rng = random.Random(seed)
    vocab = min(len(tokenizer), 152_000)
    ids = [rng.randrange(vocab) for _ in range(120)]
    if tokenizer.eos_token_id is not None:
        ids[rng.randrange(10, 110)] = tokenizer.eos_token_id
    decode = one_shot(tokenizer)
    settled_1, _ = run_steps(decode, ids, 3, [1] * (len(ids) - 3))
    settled_k, steps = run_steps(decode, ids, 3, random_chunks(len(ids) - 3, rng, most=9))
    assert decode(ids[3:]).startswith(settled_1) and decode(ids[3:]).startswith(settled_k)


# ------------------------------------------------------------------ (b) tokens that form one char


def test_bytes_of_one_character_settle_together(tiny_bpe) -> None:
    """🎉 is four byte tokens here: no text until the last, then all of it."""
    ids = tiny_bpe.encode("a🎉", add_special_tokens=False)
    assert len(ids) == 5 and tiny_bpe.decode(ids[1:2]) == PARTIAL
    decode = one_shot(tiny_bpe)
    _, steps = run_steps(decode, ids, 0, [1] * len(ids))
    assert [s.pieces[0] for s in steps] == ["a", "", "", "", "🎉"]
    assert [s.tails[0] for s in steps] == ["", PARTIAL, PARTIAL, PARTIAL, ""]
    # In one verify: the same pieces, and the cursor ends after the character.
    step = detokenize(decode, ids, TextCursor(0, 0, 0), len(ids))
    assert step.pieces == ["a", "", "", "", "🎉"] and step.cursor.read == len(ids)


def test_qwen_emoji_and_cjk_pieces(qwen) -> None:
    ids = qwen.encode("Yes 東京 🎉", add_special_tokens=False)
    decode = one_shot(qwen)
    step = detokenize(decode, ids, TextCursor(0, 0, 0), len(ids))
    assert "".join(step.pieces) == "Yes 東京 🎉" and step.tails[-1] == ""
    partial = [i for i, tail in enumerate(step.tails) if tail]
    assert partial and all(step.pieces[i] == "" and step.tails[i].endswith(PARTIAL) for i in partial)


def test_a_broken_character_settles_as_replacement(tiny_bpe) -> None:
    """A lead byte followed by an ASCII letter can never complete: its "\ufffd" is settled text."""
    lead = tiny_bpe.encode("🎉", add_special_tokens=False)[0]
    ids = [lead] + tiny_bpe.encode("ab", add_special_tokens=False)
    settled, steps = run_steps(one_shot(tiny_bpe), ids, 0, [1] * len(ids))
    assert settled == PARTIAL + "ab" and steps[0].pieces == [""] and steps[1].pieces[0].startswith(PARTIAL)


# ------------------------------------------------------------------------------ (c) special tokens


def test_special_tokens_are_no_text(tiny_bpe) -> None:
    ids = tiny_bpe.encode("Yes", add_special_tokens=False) + [tiny_bpe.eos_token_id]
    step = detokenize(one_shot(tiny_bpe), ids, TextCursor(0, 0, 0), len(ids))
    assert "".join(step.pieces) == "Yes" and step.pieces[-1] == "" and step.tails[-1] == ""


@pytest.mark.parametrize("special", ["<|im_end|>", "<|endoftext|>"])
def test_qwen_end_of_sequence_is_no_text(qwen, special) -> None:
    prompt = qwen.encode("<|im_start|>assistant\n", add_special_tokens=False)
    out = qwen.encode("Yes", add_special_tokens=False) + [qwen.convert_tokens_to_ids(special)]
    ids = prompt + out
    step = detokenize(one_shot(qwen), ids, TextCursor(len(prompt), len(prompt), len(prompt)), len(out))
    assert step.pieces == ["Yes", ""] and step.tails == ["", ""]
    # Text after a special token (a stop token the caller ignores) still reads as one decode.
    more = ids + qwen.encode(" again 東", add_special_tokens=False)
    run_steps(one_shot(qwen), more, len(prompt), [1] * (len(more) - len(prompt)))


# ------------------------------------------------------------------------------------ (d) fallback


def fake_decode(render: Callable[[list[str]], str], vocab: list[str]) -> Callable[[Sequence[int]], str]:
    return lambda ids: render([vocab[i] for i in ids])


def test_untrusted_window_falls_back_to_the_whole_output() -> None:
    """A decoder whose first token renders differently once more follow (as WordPiece's "##"): the
    window's text is then not a prefix of the longer decode, and the step decodes from `start`."""
    vocab = ["a", "##", "b", "c"]

    def render(tokens: list[str]) -> str:
        shown = ["-" if t == "##" else t for t in tokens]
        if tokens and tokens[0] == "##":  # a leading marker: "#" alone, nothing once followed
            shown[0] = "#" if len(tokens) == 1 else ""
        return "".join(shown)

    decode = fake_decode(render, vocab)
    ids = [0, 1, 2, 3]  # a - b c
    settled, steps = run_steps(decode, ids, 0, [1, 1, 1, 1])
    assert settled == "a-bc"
    assert [s.fallbacks for s in steps] == [0, 0, 1, 0]  # the window ["##"] shows "#", then ""
    # Without the fallback the window alone would have lost "b".
    assert render(["##", "b"])[len(render(["##"])):] == ""


def test_empty_window_falls_back() -> None:
    """A window whose text is empty gives no context (here: a decoder that strips all leading
    spaces, so a lone " " token shows nothing): that step decodes from `start` as well."""
    vocab = ["x", " ", " b"]
    decode = fake_decode(lambda tokens: "".join(tokens).lstrip(" "), vocab)
    ids = [0, 1, 2]
    settled, steps = run_steps(decode, ids, 0, [1, 1, 1])
    assert settled == "x  b" and [s.fallbacks for s in steps] == [0, 0, 1]


def test_window_at_start_is_the_one_shot_decode() -> None:
    """From `start` the window is the whole output: an empty text there is no reason to fall back."""
    decode = fake_decode(lambda tokens: "".join(tokens).lstrip(" "), [" ", "a"])
    settled, steps = run_steps(decode, [0, 0, 1], 0, [1, 1, 1])
    assert settled == "a" and sum(s.fallbacks for s in steps) == 0


# --------------------------------------------------------------------------------------- the cursor


def test_unsettled_tokens_of_an_earlier_step_are_redecoded(tiny_bpe) -> None:
    """Tokens between read and the new ones (an earlier tail) are part of the next window."""
    ids = tiny_bpe.encode("ok🎉", add_special_tokens=False)
    decode = one_shot(tiny_bpe)
    first = detokenize(decode, ids[:-1], TextCursor(0, 0, 0), len(ids) - 1)
    assert first.tails[-1] == PARTIAL and first.cursor.read < len(ids) - 1
    last = detokenize(decode, ids, first.cursor, 1)
    assert "".join(first.pieces) + last.pieces[0] == "ok🎉"


@pytest.mark.parametrize(("cursor", "length", "match"), [
    (TextCursor(2, 1, 3), 5, "start <= prefix <= read"),
    (TextCursor(0, 0, 6), 5, r"<= 5 \(the committed length"),
    (TextCursor(-1, 0, 0), 5, "0 <= start"),
    ((0, 0, 0), 5, "must be a TextCursor"),
    (TextCursor(0, 0, 1.5), 5, "integers"),  # type: ignore[arg-type]
])
def test_check_cursor_refuses(cursor, length, match) -> None:
    with pytest.raises(ValueError, match=match):
        check_cursor(cursor, length)


def test_check_cursor_accepts_the_edges() -> None:
    check_cursor(TextCursor(0, 0, 0), 0)
    check_cursor(TextCursor(3, 3, 5), 5)


def test_new_ids_must_follow_read() -> None:
    with pytest.raises(ValueError, match="cannot follow read"):
        detokenize(lambda ids: "", [1, 2, 3], TextCursor(0, 0, 3), 1)

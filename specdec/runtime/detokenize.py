"""Incremental detokenization: the text each new token adds, without decoding the whole output again.

A token's text depends on its neighbours (a byte-level token may be a third of a character, a
SentencePiece "▁" becomes a space or nothing), so the text of output tokens is only exact as one
decode of them all. Decoding everything every step costs O(n) per token; TGI and vLLM instead
decode a short window (their prefix_offset / read_offset): with `settled` the text of
ids[start:read], the text that ids[read:end] add is

    decode(ids[prefix:end]) minus its prefix decode(ids[prefix:read])

and it is settled (read moves to end, prefix to the old read) when it is not empty and does not end
in "\ufffd" (a partial character that later bytes may complete); until then it is only the tail.
Settled text never changes: the decode of more tokens starts with it.

The window is trusted only when its own text is a prefix of the longer decode and, unless the
window starts at `start` (then it is the one-shot decode itself), not empty (a window of only special
tokens or only a stripped "▁" gives no context). Otherwise that step falls back to decoding from
`start` (two decodes of the whole output: exact, and rare). The caller's decode must be
`tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)`, the text
contract of VerifyOutcome (special tokens such as EOS are no text).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from specdec.engine.api import TextCursor

Decode = Callable[[Sequence[int]], str]  # ids → text, thread-safe (the caller holds any lock)
PARTIAL = "\ufffd"  # what a decode shows for bytes that do not (yet) form a character


@dataclass
class TextStep:
    """The text of the new tokens: one piece (settled text) and one tail (unsettled) per token."""

    pieces: list[str]
    tails: list[str]
    cursor: TextCursor
    fallbacks: int = 0  # steps decoded from `start` because the window could not be trusted
    decoded: list[int] = field(default_factory=list)  # lengths of the decodes made (for tests, costs)


def check_cursor(cursor: object, length: int) -> None:
    """ValueError unless `cursor` is a TextCursor with 0 <= start <= prefix <= read <= length."""
    if not isinstance(cursor, TextCursor):
        raise ValueError(f"must be a TextCursor, got {type(cursor).__name__}")
    values = (cursor.start, cursor.prefix, cursor.read)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ValueError(f"start, prefix and read must be integers, got {values}")
    if not 0 <= cursor.start <= cursor.prefix <= cursor.read <= length:
        raise ValueError(f"needs 0 <= start <= prefix <= read <= {length} (the committed length before "
                         f"this call), got start={cursor.start}, prefix={cursor.prefix}, read={cursor.read}")


def detokenize(decode: Decode, ids: Sequence[int], cursor: TextCursor, new: int) -> TextStep:
    """The text that each of the last `new` ids adds after ids[cursor.start:cursor.read].

    `ids` is the whole sequence; the ids between cursor.read and the new ones are earlier tokens
    whose text is not settled yet (it was a tail). For the n-th new token, settled +
    "".join(pieces[:n]) + tails[n - 1] == decode(ids[start:end_n]) (see the module doc).
    """
    if not 0 <= new <= len(ids) - cursor.read:
        raise ValueError(f"new: {new} ids cannot follow read={cursor.read} in {len(ids)} ids")
    start, prefix, read = cursor.start, cursor.prefix, cursor.read
    step = TextStep([], [], cursor)

    def text(lo: int, hi: int) -> str:
        if lo == hi:
            return ""
        step.decoded.append(hi - lo)
        return decode(ids[lo:hi])

    window: str | None = None  # text(prefix, read), kept until prefix or read move
    for end in range(len(ids) - new + 1, len(ids) + 1):
        if window is None:
            window = text(prefix, read)
        longer = text(prefix, end)
        if longer.startswith(window) and (window or prefix == start):
            rest = longer[len(window):]
        else:  # no trustworthy context: the exact text from the output's start
            step.fallbacks += 1
            rest = text(start, end)[len(text(start, read)):]
        if rest and not rest.endswith(PARTIAL):
            step.pieces.append(rest)
            step.tails.append("")
            prefix, read, window = read, end, None
        else:
            step.pieces.append("")
            step.tails.append(rest)
    step.cursor = TextCursor(start, prefix, read)
    return step

"""Stop conditions and the output's text.

Tokens after max_new_tokens or after the first stop token are cut, stop strings cut at the fewest
tokens whose text contains one, and a full context window ends the run. These are stopping rules on
the emitted sequence, so the kept prefix is an exact sample of the target's prefix
(docs/algorithms.md §8, "Stop conditions").

The text comes with each verify (VerifyOutcome.text_pieces / text_tails, decoded incrementally by
the verifier from the run's TextCursor, specdec.runtime.detokenize): no round trip per iteration.
Nothing here writes the run's state: absorb and text_delta return values the loop applies.
After every iteration `text + text_tail` is the one-shot decode of the output (special tokens such
as EOS are no text); `text` is settled and never changes, the tail is a partial character.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from orchestrator.run import Run
from specdec.engine.api import TextCursor, VerifyOutcome

Decode = Callable[[list[int]], Awaitable[str]]  # token ids → text (the verifier's Decode RPC)
PARTIAL = "\ufffd"  # what a decode shows for bytes that do not form a character yet


@dataclass(frozen=True)
class Absorbed:
    """What an iteration adds to the output (the loop applies it to RunState)."""

    kept: list[int]  # the verifier's tokens that stay (after max_new_tokens and every stop condition)
    text: str  # the output's settled text after them
    text_tail: str  # the unsettled end, as a one-shot decode shows it
    text_cursor: TextCursor | None  # where the verifier's incremental decoding stands after them
    finish_reason: str | None  # None: the run goes on


async def absorb(run: Run, outcome: VerifyOutcome, *, decode: Decode, max_context: int) -> Absorbed:
    """An iteration's tokens and their text, with every stop condition applied. `decode` is used only
    when the verifier sent no text (an engine that failed to decode it): then the cursor goes back to
    the output's start and the next verify rebuilds the text from there."""
    settings, state = run.settings, run.state
    before = len(state.generated)
    finish_reason = None
    kept = list(outcome.tokens[: settings.max_new_tokens - before])
    for i, token in enumerate(kept):
        if token in settings.stop_ids:
            del kept[i + 1:]
            finish_reason = "eos"
            break
    texts, cursor = await _texts(run, outcome, kept, decode)  # (settled, partial) after each kept token
    text, text_tail = state.text, state.text_tail
    cut = _stop_cut(state.text, [settled + tail for settled, tail in texts], settings.stop)
    if cut is not None:
        count, end = cut
        del kept[count:]
        settled, tail = texts[count - 1]
        text, text_tail = (settled + tail)[:end], ""
        finish_reason = "stop"
    elif kept:
        text, text_tail = texts[-1]
    generated = before + len(kept)
    if finish_reason is None and generated >= settings.max_new_tokens:
        finish_reason = "length"
    if finish_reason is None and max_context and len(settings.prompt_ids) + generated >= max_context:
        finish_reason = "length"
    return Absorbed(kept, text, text_tail, cursor, finish_reason)


async def _texts(run: Run, outcome: VerifyOutcome, kept: list[int],
                 decode: Decode) -> tuple[list[tuple[str, str]], TextCursor]:
    """The output's text after each kept token (settled text, the unsettled rest), and the cursor after."""
    state = run.state
    cursor, pieces, tails = state.text_cursor, outcome.text_pieces, outcome.text_tails
    if outcome.text_cursor is not None and len(pieces) >= len(kept) and len(tails) >= len(kept):
        settled = "" if cursor is not None and cursor.read == cursor.start else state.text
        texts = []
        for piece, tail in zip(pieces[: len(kept)], tails, strict=False):
            settled += piece
            texts.append((settled, tail))
        return texts, outcome.text_cursor
    # No text from the verifier: decode here, and have the next verify rebuild it from the start.
    start = len(run.settings.prompt_ids)
    generated = state.generated
    texts = []
    for n in range(1, len(kept) + 1):
        text = await decode(generated + kept[:n])
        settled = text.rstrip(PARTIAL)
        texts.append((settled, text[len(settled):]))
    return texts, TextCursor(start, start, start)


def _stop_cut(before: str, texts: Sequence[str], stops: Sequence[str]) -> tuple[int, int] | None:
    """(tokens kept, characters of text kept) at the fewest tokens whose text holds a stop string."""
    if not stops:
        return None
    reach = max(map(len, stops)) - 1  # a stop string may begin this far back in the earlier text
    for count, text in enumerate(texts, start=1):
        hit = find_stop(text, stops, max(0, len(before) - reach))
        if hit is not None:
            return count, hit
    return None


def context_full(run: Run, max_context: int) -> bool:
    """Whether the run's sequence fills the target's context window (0: no limit)."""
    return bool(max_context) and len(run.settings.prompt_ids) + len(run.state.generated) >= max_context


def find_stop(text: str, stops: Sequence[str], start: int = 0) -> int | None:
    """Where the earliest stop string starts in `text` (searched from `start`), or None."""
    hits = [i for i in (text.find(s, start) for s in stops) if i >= 0]
    return min(hits) if hits else None


def text_delta(run: Run, final: bool) -> tuple[str, int]:
    """The not-yet-streamed text that can no longer change (everything settled but a possible
    stop-string start; at the end, the partial character too, as the one-shot decode shows it), and
    how many characters of the text are streamed once it is sent (RunState.text_sent)."""
    state = run.state
    text = state.text + state.text_tail if final else state.text
    end = len(text)
    if not final:
        hold = 0
        for stop in run.settings.stop:
            for n in range(min(len(stop) - 1, end), hold, -1):
                if text.endswith(stop[:n], 0, end):
                    hold = n
                    break
        end -= hold
    delta = text[state.text_sent:end] if end > state.text_sent else ""
    return delta, max(state.text_sent, end)

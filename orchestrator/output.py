"""Stop conditions and the output's text.

Tokens after max_new_tokens or after the first stop token are cut, stop strings cut at the fewest
tokens whose text contains one, and a full context window ends the run. These are stopping rules on
the emitted sequence, so the kept prefix is an exact sample of the target's prefix
(docs/algorithms.md §8, "Stop conditions").

The text comes with each verify (VerifyOutcome.text_pieces / text_tails, decoded incrementally by
the verifier from the run's TextCursor, specdec.runtime.detokenize): no round trip per iteration.
After every iteration `text + text_tail` is the one-shot decode of the output (special tokens such
as EOS are no text); `text` is settled and never changes, the tail is a partial character.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

from orchestrator.run import Run
from specdec.engine.api import TextCursor, VerifyOutcome

Decode = Callable[[list[int]], Awaitable[str]]  # token ids → text (the verifier's Decode RPC)
PARTIAL = "\ufffd"  # what a decode shows for bytes that do not form a character yet


async def absorb(run: Run, outcome: VerifyOutcome, *, decode: Decode, max_context: int) -> list[int]:
    """Add an iteration's tokens and their text to the output, applying every stop condition;
    returns the tokens kept. `decode` is used only when the verifier sent no text (an engine that
    failed to decode it): then the text is rebuilt from the output's start on the next verify."""
    settings, state = run.settings, run.state
    before = len(state.generated)
    kept = list(outcome.tokens[: settings.max_new_tokens - before])
    for i, token in enumerate(kept):
        if token in settings.stop_ids:
            del kept[i + 1:]
            state.finish_reason = "eos"
            break
    texts = await _texts(run, outcome, kept, decode)  # (settled, partial) after each kept token
    cut = _stop_cut(state.text, [settled + tail for settled, tail in texts], settings.stop)
    if cut is not None:
        count, end = cut
        del kept[count:]
        settled, tail = texts[count - 1]
        state.text, state.text_tail = (settled + tail)[:end], ""
        state.finish_reason = "stop"
    elif kept:
        state.text, state.text_tail = texts[-1]
    state.generated.extend(kept)
    if state.finish_reason is None and len(state.generated) >= settings.max_new_tokens:
        state.finish_reason = "length"
    if state.finish_reason is None and context_full(run, max_context):
        state.finish_reason = "length"
    return kept


async def _texts(run: Run, outcome: VerifyOutcome, kept: list[int], decode: Decode) -> list[tuple[str, str]]:
    """The output's text after each kept token: (settled text, the unsettled rest)."""
    state = run.state
    cursor, pieces, tails = state.text_cursor, outcome.text_pieces, outcome.text_tails
    if outcome.text_cursor is not None and len(pieces) >= len(kept) and len(tails) >= len(kept):
        settled = "" if cursor is not None and cursor.read == cursor.start else state.text
        texts = []
        for piece, tail in zip(pieces[: len(kept)], tails, strict=False):
            settled += piece
            texts.append((settled, tail))
        state.text_cursor = outcome.text_cursor
        return texts
    # No text from the verifier: decode here, and have the next verify rebuild it from the start.
    start = len(run.settings.prompt_ids)
    state.text_cursor = TextCursor(start, start, start)
    generated = state.generated
    texts = []
    for n in range(1, len(kept) + 1):
        text = await decode(generated + kept[:n])
        settled = text.rstrip(PARTIAL)
        texts.append((settled, text[len(settled):]))
    return texts


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


def text_delta(run: Run, final: bool) -> str:
    """The not-yet-streamed text that can no longer change: everything settled but a possible
    stop-string start; at the end, the partial character too (as the one-shot decode shows it)."""
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
    state.text_sent = max(state.text_sent, end)
    return delta

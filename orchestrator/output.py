"""Stop conditions and the streamed text.

Tokens after max_new_tokens or after the first stop token are cut, stop strings cut at the
fewest tokens whose text contains one, and a full context window ends the run. These are
stopping rules on the emitted sequence, so the kept prefix is an exact sample of the target's
prefix (docs/algorithms.md §8, "Stop conditions").
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from orchestrator.run import Run

Decode = Callable[[list[int]], Awaitable[str]]  # token ids → text, with the target's tokenizer


async def absorb(run: Run, tokens: list[int], *, decode: Decode, max_context: int) -> list[int]:
    """Add an iteration's tokens to the output, applying every stop condition; returns what was kept."""
    before = len(run.generated)
    kept = list(tokens[: run.max_new_tokens - before])
    for i, token in enumerate(kept):
        if token in run.stop_ids:
            del kept[i + 1:]
            run.finish_reason = "eos"
            break
    run.generated.extend(kept)
    if run.finish_reason is None and len(run.generated) >= run.max_new_tokens:
        run.finish_reason = "length"
    text = await decode(run.generated)
    if run.stop and find_stop(text, run.stop) is not None:
        text = await cut_at_stop(run, before, text, decode)
        run.finish_reason = "stop"
    run.text = text
    if run.finish_reason is None and context_full(run, max_context):
        run.finish_reason = "length"
    return run.generated[before:]


def context_full(run: Run, max_context: int) -> bool:
    """Whether the run's sequence fills the target's context window (0: no limit)."""
    return bool(max_context) and len(run.prompt_ids) + len(run.generated) >= max_context


async def cut_at_stop(run: Run, before: int, full_text: str, decode: Decode) -> str:
    """Keep the fewest new tokens whose text contains a stop string; the text ends before it."""
    for n in range(before + 1, len(run.generated) + 1):
        text = full_text if n == len(run.generated) else await decode(run.generated[:n])
        hit = find_stop(text, run.stop)
        if hit is not None:
            del run.generated[n:]
            return text[:hit]
    raise AssertionError("unreachable: the full text holds a stop string")


def find_stop(text: str, stops: Sequence[str]) -> int | None:
    """Where the earliest stop string starts in `text`, or None."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None


def text_delta(run: Run, final: bool) -> str:
    """The not-yet-streamed text that can no longer change (held back: a possible stop-string
    start, and an incomplete character at the end)."""
    text = run.text
    end = len(text)
    if not final:
        while end > 0 and text[end - 1] == "\ufffd":
            end -= 1
        hold = 0
        for stop in run.stop:
            for n in range(min(len(stop) - 1, end), hold, -1):
                if text.endswith(stop[:n], 0, end):
                    hold = n
                    break
        end -= hold
    delta = text[run.text_sent:end] if end > run.text_sent else ""
    run.text_sent = max(run.text_sent, end)
    return delta

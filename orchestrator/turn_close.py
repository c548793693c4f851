"""The close of a chat turn, passed through the target before its session is released.

A chat client resends the whole conversation every turn: the prompt it sent, the answer it got, the
chat template's close of that answer (Qwen's `<|im_end|>\\n`), then its new message. The prefix
cache (docs/algorithms.md §16) holds what a pass took in: the prompt and the answer less its last
token, which only the next token's pass would have read. So the next turn's first pass computes the
answer's last token and the template's close beside the new message: 2–3 rows on top of the new
message's 20–30 on the default pair, a sixth more first-token time on a CPU, where a pass costs about
its rows (bench/RESULTS.md, "The close of a chat turn").

Once a chat request ends, with no other request running, the orchestrator renders the conversation
with the answer as its last turn and passes the tokens the session lacks through the target, then
releases the session: its cached tail then ends where the next turn's new message begins (the
tokens the rendering adds after the close, such as the next assistant header, are cached too and
found as far as the next prompt agrees with them). Exact: the cache holds the keys and values of a
token prefix, whoever computed them; a pass over them is the pass a cold prompt would make.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from specdec.trees import common_prefix

# At most this many tokens are added: a close is a few template tokens. More means the rendering
# tells another story than the session (a template that rewrites earlier turns): not a close.
MAX_TURN_CLOSE_TOKENS = 16
# Finish reasons whose answer the client has whole, and may send back as its next turn.
CLOSING_FINISHES = frozenset({"eos", "length", "stop"})


@dataclass(frozen=True)
class TurnClose:
    """Keep the session's first `base` tokens, then add `append`: the session then holds the rendering."""

    base: int
    append: tuple[int, ...]


def turn_close(prompt: Sequence[int], generated: Sequence[int], rendered: Sequence[int],
               limit: int = MAX_TURN_CLOSE_TOKENS) -> TurnClose | None:
    """What brings a session holding prompt + generated to `rendered` (the conversation with the
    answer as its last turn, as the chat template writes it). None when the rendering parts from the
    prompt, adds nothing, or would add more than `limit` tokens."""
    held = [*prompt, *generated]
    base = common_prefix(held, rendered)
    append = tuple(rendered[base:])
    if base < len(prompt) or not append or len(append) > limit:
        return None
    return TurnClose(base, append)

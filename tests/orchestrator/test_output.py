"""Stop conditions and the output's text (orchestrator.output), with stand-in tokenizers: the text
comes in pieces with each verify (specdec.runtime.detokenize, as the verifier computes it)."""

from __future__ import annotations

from orchestrator.output import absorb, find_stop
from orchestrator.speculation import _stream_text, _take_output
from specdec.engine.api import VerifyOutcome
from specdec.runtime.detokenize import detokenize
from tests.orchestrator.helpers import make_run

WORDS = {0: "a", 1: "b", 2: "c", 3: "d", 4: "e", 5: ""}  # 5: EOS, a special token: no text
# A byte-level stand-in: 6 and 7 are the two halves of "é" (UTF-8 c3 a9).
BYTES = {0: b"a", 1: b"b", 2: b"c", 3: b"d", 4: b"e", 5: b"", 6: b"\xc3", 7: b"\xa9"}


def decode_words(ids) -> str:
    return "".join(WORDS[t] for t in ids)


def decode_bytes(ids) -> str:
    return b"".join(BYTES[t] for t in ids).decode("utf-8", errors="replace")


def outcome(run, tokens: list[int], decode=decode_bytes) -> VerifyOutcome:
    """What the verifier answers: the tokens and their text from the run's cursor."""
    ids = run.committed + tokens
    step = detokenize(decode, ids, run.state.text_cursor, len(tokens))
    return VerifyOutcome(tokens=tokens, accepted_nodes=[], accept_flags=[], num_drafted=0,
                         committed_len=len(ids), text_pieces=step.pieces, text_tails=step.tails,
                         text_cursor=step.cursor)


async def no_decode(ids):
    raise AssertionError("the verifier sent the text: no Decode call")


async def kept(run, verified: VerifyOutcome, *, decode=no_decode, max_context: int = 0) -> list[int]:
    """absorb, applied to the run's state as the loop applies it: the tokens kept."""
    absorbed = await absorb(run, verified, decode=decode, max_context=max_context)
    _take_output(run.state, absorbed)
    return absorbed.kept


async def test_absorb_writes_nothing_of_the_run():
    run = make_run(max_new_tokens=10, stop=["cd"])
    before = (list(run.state.generated), run.state.text, run.state.text_cursor, run.state.finish_reason)
    absorbed = await absorb(run, outcome(run, [0, 1, 2, 3]), decode=no_decode, max_context=0)
    assert (absorbed.kept, absorbed.text, absorbed.finish_reason) == ([0, 1, 2, 3], "ab", "stop")
    assert (run.state.generated, run.state.text, run.state.text_cursor, run.state.finish_reason) == before


async def test_eos_and_max_new_tokens_cut_the_tokens():
    run = make_run(max_new_tokens=10)  # EOS = 5
    assert await kept(run, outcome(run, [1, 5, 2])) == [1, 5]
    assert run.state.finish_reason == "eos" and run.state.text == "b"  # the EOS token is no text
    run = make_run(max_new_tokens=3)
    assert await kept(run, outcome(run, [1, 2])) == [1, 2]
    assert run.state.finish_reason is None
    assert await kept(run, outcome(run, [3, 4])) == [3]
    assert run.state.finish_reason == "length" and run.state.text == "bcd"
    run = make_run(max_new_tokens=10)  # the prompt has 3 tokens: the window is full after 2 more
    assert await kept(run, outcome(run, [1, 2]), max_context=5) == [1, 2]
    assert run.state.finish_reason == "length"


async def test_a_stop_string_keeps_the_fewest_tokens_and_ends_the_text_before_it():
    run = make_run(max_new_tokens=10, stop=["zz", "cd"])
    assert await kept(run, outcome(run, [0, 1, 2, 3, 4])) == [0, 1, 2, 3]
    assert run.state.finish_reason == "stop" and run.state.text == "ab"


async def test_a_stop_string_across_iterations_is_found():
    run = make_run(max_new_tokens=10, stop=["bc"])
    await kept(run, outcome(run, [0, 1]))
    assert await kept(run, outcome(run, [2, 3])) == [2]
    assert run.state.text == "a" and run.state.finish_reason == "stop"


async def test_a_character_split_over_tokens_and_iterations_is_held_back_then_whole():
    run = make_run(max_new_tokens=10)
    await kept(run, outcome(run, [0, 6]))
    assert (run.state.text, run.state.text_tail) == ("a", "\ufffd")
    assert _stream_text(run, False) == "a"
    await kept(run, outcome(run, [7, 1]))
    assert (run.state.text, run.state.text_tail) == ("aéb", "")
    assert _stream_text(run, False) == "éb"
    assert run.state.text == decode_bytes(run.state.generated)


async def test_without_text_from_the_verifier_it_decodes_and_the_next_verify_rebuilds_it():
    run = make_run(max_new_tokens=10)
    calls = []

    async def decode(ids):
        calls.append(list(ids))
        return decode_bytes(ids)

    # No text_cursor: an engine that failed to decode.
    plain = VerifyOutcome(tokens=[0, 6], accepted_nodes=[], accept_flags=[], num_drafted=0, committed_len=5)
    await kept(run, plain, decode=decode)
    assert (run.state.text, run.state.text_tail) == ("a", "\ufffd") and calls == [[0], [0, 6]]
    assert run.state.text_cursor.read == run.state.text_cursor.start  # rebuild from the output's start
    await kept(run, outcome(run, [7]))
    assert run.state.text == "aé" == decode_bytes(run.state.generated)


def test_find_stop():
    assert find_stop("abcd", ["cd", "b"]) == 1
    assert find_stop("abcd", ["x"]) is None
    assert find_stop("abcdab", ["ab"], 1) == 4


def test_streamed_text_holds_back_what_may_still_change():
    run = make_run(stop=["cde"])
    run.state.text = "abc"
    assert _stream_text(run, False) == "ab"  # "c" may start the stop string
    run.state.text, run.state.text_tail = "abcx", "\ufffd"
    assert _stream_text(run, False) == "cx"  # an incomplete character is held back
    assert _stream_text(run, True) == "\ufffd"  # at the end it is shown as the one-shot decode shows it
    assert _stream_text(run, True) == ""

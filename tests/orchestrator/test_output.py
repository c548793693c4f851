"""Stop conditions and streamed text (orchestrator.output), with a stand-in tokenizer."""

from __future__ import annotations

from orchestrator.output import absorb, find_stop, text_delta
from tests.orchestrator.helpers import make_run

WORDS = {0: "a", 1: "b", 2: "c", 3: "d", 4: "e", 5: "<eos>"}


async def decode(ids: list[int]) -> str:
    return "".join(WORDS[t] for t in ids)


async def test_eos_and_max_new_tokens_cut_the_tokens():
    run = make_run(max_new_tokens=10)  # EOS = 5
    assert await absorb(run, [1, 5, 2], decode=decode, max_context=0) == [1, 5]
    assert run.finish_reason == "eos" and run.text == "b<eos>"
    run = make_run(max_new_tokens=3)
    assert await absorb(run, [1, 2], decode=decode, max_context=0) == [1, 2] and run.finish_reason is None
    assert await absorb(run, [3, 4], decode=decode, max_context=0) == [3] and run.finish_reason == "length"
    run = make_run(max_new_tokens=10)  # the prompt has 3 tokens: the window is full after 2 more
    assert await absorb(run, [1, 2], decode=decode, max_context=5) == [1, 2] and run.finish_reason == "length"


async def test_a_stop_string_keeps_the_fewest_tokens_and_ends_the_text_before_it():
    run = make_run(max_new_tokens=10, stop=["zz", "cd"])
    assert await absorb(run, [0, 1, 2, 3, 4], decode=decode, max_context=0) == [0, 1, 2, 3]
    assert run.finish_reason == "stop" and run.text == "ab"


def test_find_stop():
    assert find_stop("abcd", ["cd", "b"]) == 1
    assert find_stop("abcd", ["x"]) is None


def test_streamed_text_holds_back_what_may_still_change():
    run = make_run(stop=["cde"])
    run.text = "abc"
    assert text_delta(run, False) == "ab"  # "c" may start the stop string
    run.text = "abcx\ufffd"
    assert text_delta(run, False) == "cx"  # an incomplete character is held back
    run.text = "abcx\ufffdy"
    assert text_delta(run, True) == "\ufffdy"
    assert text_delta(run, True) == ""

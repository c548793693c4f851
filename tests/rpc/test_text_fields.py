"""The text fields of Verify (VerifyRequest.text, VerifyOutcome.text_*) on the wire: lossless round
trips through bytes, absence kept apart from zero values, and old messages without them."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from specdec.engine.api import TextCursor, VerifyOutcome, VerifyRequest
from specdec.rpc import convert
from specdec.rpc.v1 import verifier_pb2
from specdec.sampling import SamplingParams
from specdec.verification.base import MethodParams

FAST = settings(max_examples=60, deadline=None)
offsets = st.integers(0, 2**40)
cursors = st.builds(TextCursor, offsets, offsets, offsets)  # the engine checks their order, not the wire
texts = st.text(max_size=6)  # any Unicode the decoder can give, "\ufffd" included


def via_bytes(msg):
    return type(msg).FromString(msg.SerializeToString())


def request(text: TextCursor | None) -> VerifyRequest:
    return VerifyRequest("s", 3, [1], [2, 3], [-1, 0], "token", MethodParams(seed=1), SamplingParams(),
                         text=text)


@FAST
@given(st.one_of(st.none(), cursors))
def test_verify_request_text_round_trip(cursor) -> None:
    back = convert.verify_request_from_proto(via_bytes(convert.verify_request_to_proto(request(cursor))))
    assert back.text == cursor


def test_a_cursor_of_zeros_is_not_absent() -> None:
    zero = TextCursor(0, 0, 0)
    msg = via_bytes(convert.verify_request_to_proto(request(zero)))
    assert msg.HasField("text") and convert.verify_request_from_proto(msg).text == zero
    assert not via_bytes(convert.verify_request_to_proto(request(None))).HasField("text")


@FAST
@given(pieces=st.lists(texts, max_size=6),
       tails=st.lists(st.sampled_from(["", "\ufffd", "a\ufffd"]), max_size=6),
       cursor=st.one_of(st.none(), cursors))
def test_verify_outcome_text_round_trip(pieces, tails, cursor) -> None:
    outcome = VerifyOutcome([7] * len(pieces), [], [], 0, 9, text_pieces=pieces, text_tails=tails,
                            text_cursor=cursor)
    back = convert.verify_outcome_from_proto(via_bytes(convert.verify_outcome_to_proto(outcome)))
    assert (back.text_pieces, back.text_tails, back.text_cursor) == (pieces, tails, cursor)
    assert back == outcome


def test_messages_without_the_fields_read_as_no_text() -> None:
    """A client or server built before the fields existed sends neither: no text, as before."""
    old_request = verifier_pb2.VerifyRequest(session_id="s", base_len=0, append=[1], method="token")
    assert convert.verify_request_from_proto(via_bytes(old_request)).text is None
    old_outcome = verifier_pb2.VerifyOutcome(tokens=[4], committed_len=2)
    back = convert.verify_outcome_from_proto(via_bytes(old_outcome))
    assert (back.text_pieces, back.text_tails, back.text_cursor) == ([], [], None)

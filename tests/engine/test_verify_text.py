"""The verifier engine returns the text of the tokens each verify emits (VerifyRequest.text): over
many verifies of a tiny random model with a byte-level BPE (random tokens split characters all the
time), the settled pieces plus the last tail are the one-shot decode of the output at every token."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from specdec.engine.api import TextCursor, VerifyOutcome, VerifyRequest
from specdec.engine.verifier import VerifierEngine
from specdec.errors import InvalidRequest
from specdec.runtime.detokenize import PARTIAL
from specdec.runtime.loading import load_model
from specdec.sampling import SamplingParams
from specdec.trees import sequence_parents
from specdec.verification.base import MethodParams
from tests.bpe_helpers import save_byte_level_model

T1 = SamplingParams(temperature=1.0)


@pytest.fixture(scope="module")
def byte_verifier(tmp_path_factory) -> VerifierEngine:
    directory = save_byte_level_model(tmp_path_factory.mktemp("bpe") / "model", max_context=256)
    return VerifierEngine(load_model(directory, threads=1))


def one_shot(engine: VerifierEngine, ids: list[int]) -> str:
    return engine.loaded.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def verify_request(engine: VerifierEngine, session: str, committed: list[int], told: int, rng: random.Random,
                   text: TextCursor | None, k: int = 4) -> VerifyRequest:
    """A random sequence draft of k tokens with uniform draft rows (method "token")."""
    vocab = engine.info().vocab_size
    draft = [rng.randrange(vocab) for _ in range(k)]
    return VerifyRequest(session, told, committed[told:], draft, sequence_parents(k), "token",
                         MethodParams(seed=rng.randrange(2**32)), T1,
                         draft_probs=torch.full((k + 1, vocab), 1.0 / vocab), text=text)


def check_outcome(engine: VerifierEngine, out: VerifyOutcome, output: list[int], settled: str) -> None:
    """The contract at every emitted token (output: the output tokens committed before this verify)."""
    assert len(out.text_pieces) == len(out.text_tails) == len(out.tokens)
    for n in range(1, len(out.tokens) + 1):
        shown = settled + "".join(out.text_pieces[:n]) + out.text_tails[n - 1]
        assert shown == one_shot(engine, output + out.tokens[:n])


@pytest.mark.parametrize("seed", range(3))
def test_pieces_over_many_verifies_are_the_one_shot_decode(byte_verifier, seed) -> None:
    engine, rng = byte_verifier, random.Random(seed)
    tokenizer = engine.loaded.tokenizer
    prompt = tokenizer.encode("Say 東京:", add_special_tokens=False)
    session, committed, told = f"text-{seed}", list(prompt), 0
    cursor, settled, partial = TextCursor(len(prompt), len(prompt), len(prompt)), "", 0
    while len(committed) < 200:
        if len(committed) > 100 and told:  # once: the session is lost and the context resent
            engine.release(session)
            told = 0
        out = engine.verify(verify_request(engine, session, committed, told, rng, cursor))
        check_outcome(engine, out, committed[len(prompt):], settled)
        settled += "".join(out.text_pieces)
        partial += sum(tail.endswith(PARTIAL) for tail in out.text_tails)
        committed += out.tokens
        told = len(committed)
        assert out.text_cursor is not None and out.text_cursor.start == len(prompt)
        assert out.text_cursor.read <= len(committed)
        cursor = out.text_cursor
    assert settled + out.text_tails[-1] == one_shot(engine, committed[len(prompt):])
    assert partial > 0  # random byte tokens left characters unfinished on the way


def test_end_of_sequence_gives_no_text(byte_verifier) -> None:
    """The tokenizer's <eos> (a special token) is emitted without text, whatever the model says."""
    engine = byte_verifier
    tokenizer = engine.loaded.tokenizer
    prompt = tokenizer.encode("Yes", add_special_tokens=False)
    eos, vocab = tokenizer.eos_token_id, engine.info().vocab_size
    rows = torch.zeros(2, vocab)
    rows[0, eos] = 1.0  # a draft that certainly proposes <eos>; whether accepted or not, check the text
    for seed in range(8):
        out = engine.verify(VerifyRequest(f"eos-{seed}", 0, prompt, [eos], [-1], "token",
                                          MethodParams(seed=seed), T1, draft_probs=rows,
                                          text=TextCursor(1, 1, 1)))
        check_outcome(engine, out, prompt[1:], "")
        for token, piece, tail in zip(out.tokens, out.text_pieces, out.text_tails, strict=True):
            if token == eos:
                assert piece == tail == ""


def test_no_text_unless_asked(byte_verifier) -> None:
    engine, rng = byte_verifier, random.Random(0)
    out = engine.verify(verify_request(engine, "plain", [5, 6, 7], 0, rng, None))
    assert out.tokens and (out.text_pieces, out.text_tails, out.text_cursor) == ([], [], None)
    assert out.text_fallbacks == 0


@pytest.mark.parametrize(("cursor", "match"), [
    (TextCursor(2, 1, 2), "start <= prefix <= read"),
    (TextCursor(1, 1, 4), r"<= 3 \(the committed length"),
    ((1, 1, 1), "must be a TextCursor"),
])
def test_a_bad_cursor_is_refused_before_any_work(byte_verifier, cursor, match) -> None:
    engine, rng = byte_verifier, random.Random(0)
    request = verify_request(engine, "bad-cursor", [5, 6, 7], 0, rng, None)
    batches = engine.stats()["batch_calls"]
    with pytest.raises(InvalidRequest, match=f"text: .*{match}"):
        engine.verify(dataclasses.replace(request, text=cursor))
    assert engine.stats()["batch_calls"] == batches  # no forward pass ran


def test_a_lean_verify_that_needs_rows_keeps_the_cursor(byte_verifier) -> None:
    """No token emitted, no text: the cursor comes back as it was, for the retry."""
    engine = byte_verifier
    vocab = engine.info().vocab_size
    cursor = TextCursor(2, 2, 3)
    for seed in range(20):
        # q = 1 for the drafted token: the target rejects it often, and then needs the row.
        request = VerifyRequest(f"lean-{seed}", 0, [5, 6, 7], [9], [-1], "token", MethodParams(seed=seed), T1,
                                draft_token_probs=[1.0], text=cursor)
        out = engine.verify(request)
        if out.draft_rows_needed:
            assert (out.tokens, out.text_pieces, out.text_tails, out.text_cursor) == ([], [], [], cursor)
            rows = torch.zeros(1, vocab)
            rows[0, 9] = 1.0
            retry = engine.verify(dataclasses.replace(request, draft_row_indices=[0], draft_row_values=rows))
            check_outcome(engine, retry, [7], one_shot(engine, [7]))  # output from start = 2
            return
    pytest.fail("no lean verify needed a row in 20 seeds")


def test_word_level_tokenizer_text(verifier) -> None:
    """The tiny word-level test models (no decoder: words joined by spaces) follow the contract too."""
    rng, committed, told = random.Random(1), [1, 2, 3], 0
    cursor, settled = TextCursor(3, 3, 3), ""
    for _ in range(6):
        out = verifier.verify(verify_request(verifier, "words", committed, told, rng, cursor, k=3))
        check_outcome(verifier, out, committed[3:], settled)
        settled += "".join(out.text_pieces)
        committed += out.tokens
        told, cursor = len(committed), out.text_cursor

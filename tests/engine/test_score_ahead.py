"""A verify with score_ahead runs the next target-only step's pass before that step is asked for
(specdec.engine.verifier, "Scoring ahead"): the step asked for next takes its rows and emits what it
would have emitted anyway; any other call runs its own pass; a released session drops it."""

from __future__ import annotations

import time

import pytest

from specdec.engine.api import VerifyRequest
from specdec.engine.verifier import VerifierEngine
from specdec.methods import TARGET_ONLY_VERIFICATION
from specdec.sampling import SamplingParams
from specdec.verification.base import MethodParams

PROMPT = [1, 2, 3, 4]
WAIT_S = 10.0  # bound on waiting for the thread that scores ahead


def _step(session: str, base: int, append: list[int], temperature: float, *, ahead: bool,
          tree: tuple[list[int], list[int]] = ([], []), deterministic: bool = False) -> VerifyRequest:
    tokens, parents = tree
    return VerifyRequest(session_id=session, base_len=base, append=append, tree_tokens=tokens,
                         tree_parents=parents, method=TARGET_ONLY_VERIFICATION, params=MethodParams(seed=11),
                         sampling=SamplingParams(temperature=temperature), score_ahead=ahead,
                         deterministic=deterministic)


def _wait_for(predicate, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} within {WAIT_S:g} s")
        time.sleep(0.002)


def _decode(engine: VerifierEngine, session: str, steps: int, temperature: float, *,
            ahead: bool) -> list[int]:
    """`steps` target-only steps after PROMPT; with `ahead`, each next one waits until its pass is parked."""
    out: list[int] = []
    base, append = 0, list(PROMPT)
    for _ in range(steps):
        scored = engine.ahead_scores
        outcome = engine.verify(_step(session, base, append, temperature, ahead=ahead))
        out += outcome.tokens
        base, append = outcome.committed_len, []
        if ahead:
            _wait_for(lambda before=scored: engine.ahead_scores > before, "no pass was scored ahead")
    engine.release(session)
    return out


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_step_scored_ahead_emits_what_the_step_itself_emits(target_model, temperature):
    engine = VerifierEngine(target_model)
    plain = _decode(engine, "plain", 12, temperature, ahead=False)
    hits = engine.score_hits
    ahead = _decode(engine, "ahead", 12, temperature, ahead=True)
    assert ahead == plain
    assert engine.score_hits - hits == 11  # every step after the first took its parked rows
    assert engine.ahead_scores == 12


def test_a_verify_of_a_draft_runs_its_own_pass_after_one_scored_ahead(target_model):
    engine = VerifierEngine(target_model)
    draft = ([5, 6, 7], [-1, 0, 1])
    reference = []
    for session, ahead in (("plain", False), ("ahead", True)):
        first = engine.verify(_step(session, 0, list(PROMPT), 0.0, ahead=ahead))
        if ahead:
            _wait_for(lambda: engine.ahead_scores == 1, "no pass was scored ahead")
        hits = engine.score_hits
        second = engine.verify(_step(session, first.committed_len, [], 0.0, ahead=False, tree=draft,
                                     deterministic=True))
        assert engine.score_hits == hits  # the parked rows were for another step
        reference.append((first.tokens, second.tokens, second.accepted_nodes, second.committed_len))
    assert reference[0] == reference[1]


def test_a_released_session_drops_its_pass_scored_ahead(target_model):
    engine = VerifierEngine(target_model)
    gate_entered, before = [], engine._score_ahead

    def slow_score_ahead(*args):  # the release lands before the thread scoring ahead takes the session
        gate_entered.append(True)
        time.sleep(0.05)
        before(*args)

    engine._score_ahead = slow_score_ahead
    engine.verify(_step("gone", 0, list(PROMPT), 0.0, ahead=True))
    _wait_for(lambda: gate_entered, "the pass scored ahead did not start")
    assert engine.release("gone")
    assert engine._ahead is not None
    engine._ahead.submit(lambda: None).result(timeout=WAIT_S)  # the one thread has finished the pass
    assert engine.ahead_scores == 0
    assert "gone" not in engine.sessions

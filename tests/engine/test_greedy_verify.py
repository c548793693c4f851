"""At temperature 0 the verifier decides descend rules from each row's argmax (greedy_descent) instead
of warping one-hot rows: its outcomes are those of the rule itself, which a swapped-in rule runs."""

from __future__ import annotations

import random

import pytest

from specdec.engine.api import VerifyRequest
from specdec.engine.verifier import VerifierEngine
from specdec.sampling import SamplingParams
from specdec.verification.base import MethodParams
from specdec.verification.dispatch import verify

PROMPT = [1, 2, 3]
GREEDY = SamplingParams(temperature=0.0)


def _the_rule_itself(*args, **kwargs):
    return verify(*args, **kwargs)


def _request(session: str, base: int, append: list[int], tree: tuple[list[int], list[int]], method: str,
             deterministic: bool) -> VerifyRequest:
    return VerifyRequest(session_id=session, base_len=base, append=append, tree_tokens=tree[0],
                         tree_parents=tree[1], method=method, params=MethodParams(seed=3), sampling=GREEDY,
                         deterministic=deterministic)


def _greedy_output(engine: VerifierEngine, tokens: int) -> list[int]:
    base, append, out = 0, list(PROMPT), []
    while len(out) < tokens:
        outcome = engine.verify(_request("greedy", base, append, ([], []), "ersd", False))
        out += outcome.tokens
        base, append = outcome.committed_len, []
    engine.release("greedy")
    return out


def _draft(truth: list[int], rng: random.Random) -> tuple[list[int], list[int]]:
    """The true continuation's next tokens as a chain, one of them changed now and then, and sometimes
    a wrong sibling before the true first token."""
    chain = truth[:rng.randint(0, 4)]
    if chain and rng.random() < 0.4:
        chain[rng.randrange(len(chain))] = rng.randrange(8)
    tokens, parents = list(chain), list(range(-1, len(chain) - 1))
    if chain and rng.random() < 0.3 and (wrong := (chain[0] + 1) % 8) != chain[0]:
        tokens, parents = [wrong, *tokens], [-1, -1, *[p + 1 for p in parents[1:]]]
    return tokens, parents


@pytest.mark.parametrize(("method", "deterministic"), [("ersd", False), ("ersd", True), ("token", True)])
def test_greedy_outcomes_are_the_rules_outcomes(target_model, method, deterministic):
    fast, rule = VerifierEngine(target_model), VerifierEngine(target_model, verify_fn=_the_rule_itself)
    truth = _greedy_output(fast, 40)
    outcomes = {}
    for name, engine in (("fast", fast), ("rule", rule)):
        rng = random.Random(f"{method}-{deterministic}")
        base, append, out, seen = 0, list(PROMPT), [], []
        while len(out) < 30:
            outcome = engine.verify(_request(name, base, append, _draft(truth[len(out):], rng), method,
                                             deterministic))
            seen.append((outcome.tokens, outcome.accepted_nodes, outcome.accept_flags, outcome.committed_len))
            out += outcome.tokens
            base, append = outcome.committed_len, []
        assert out == truth[:len(out)]
        outcomes[name] = seen
    assert outcomes["fast"] == outcomes["rule"]
    assert sum(len(accepted) for _, accepted, _, _ in outcomes["fast"]) >= 5  # drafts were taken

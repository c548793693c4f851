"""Exact fidelity: every verification method leaves the output distributed as the target.

For random order-1 and order-2 Markov toys (target and a different drafter), one speculation
iteration — RD coins (`leading_heads`), drafting (`draft_tree`, strategy 'sample') and
verification (`verify`, the real dispatch) — is run through the enumerating RandomSource, which
yields the exact distribution of the emitted tokens. Recursing over iterations until L tokens
exist gives the exact distribution of the first L output tokens; it must equal the target's own
sequence probabilities to 1e-12, at T = 1, T = 0 (greedy), with top-k and with top-p. A
deliberately broken residual must fail the same check.

ERSD draws nothing from a RandomSource — it is driven by continuous position-keyed races — so
it cannot be enumerated. Its exactness is proved in two steps, see `test_ersd_equals_race_decoding`
here and tests/core/test_ersd_identity.py.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from specdec.drafting import draft_tree
from specdec.races import race, race_winner
from specdec.randomness import RandomSource
from specdec.verification import MethodParams, needs_draft_probs, verify
from specdec.verification import token as token_module
from specdec.verification.rd import leading_heads

from .enumeration import enumerate_outcomes, expectation, max_abs_difference
from .toy_models import SAMPLING_VARIANTS, Warped, constant_model, random_markov

TOLERANCE = 1e-12


def sequence_shape(k: int) -> tuple[int, ...]:
    return tuple(range(-1, k - 1))


def one_iteration(
    method: str,
    shape: Sequence[int],
    target: Warped,
    draft: Warped,
    prefix: Sequence[int],
    source: RandomSource,
    a: float = 1.0,
    k_max: int = 0,
    strategy: str = "sample",
    seed: int = 0,
) -> tuple[int, ...]:
    """One speculation iteration after `prefix`; returns the emitted tokens."""
    params = MethodParams(a=a, k_max=k_max, seed=seed, position=len(prefix))
    if method == "rd":
        shape = sequence_shape(leading_heads(a, k_max, source))
    tree, _ = draft_tree(
        shape, lambda path: draft.probs([*prefix, *path]), strategy, source, seed=seed, position=len(prefix)
    )
    contexts = [list(prefix)] + [[*prefix, *tree.path_tokens(i)] for i in range(len(tree))]
    target_rows = target.rows_for(contexts)
    draft_rows = draft.rows_for(contexts) if needs_draft_probs(method, params) else None
    return tuple(verify(method, tree, target_rows, draft_rows, params, source).tokens)


def exact_output_distribution(
    method: str, shape: Sequence[int], target: Warped, draft: Warped, length: int, **kwargs
) -> dict[tuple[int, ...], float]:
    """Exact distribution of the first `length` output tokens of repeated iterations.

    One iteration's outcome depends on the prefix only through the models' states (their last
    `order` tokens), so each state is enumerated once.
    """
    memory = max(target.order, draft.order)
    per_state: dict[tuple[int, ...], dict[tuple[int, ...], float]] = {}

    def iteration(prefix: tuple[int, ...]) -> dict[tuple[int, ...], float]:
        state = prefix[len(prefix) - memory :] if memory else ()
        if state not in per_state:
            per_state[state] = enumerate_outcomes(
                lambda source: one_iteration(method, shape, target, draft, prefix, source, **kwargs)
            )
        return per_state[state]

    frontier: dict[tuple[int, ...], float] = {(): 1.0}
    finished: dict[tuple[int, ...], float] = {}
    while frontier:
        following: dict[tuple[int, ...], float] = {}
        for prefix, probability in frontier.items():
            for emitted, p_emitted in iteration(prefix).items():
                extended = prefix + emitted
                bucket = finished if len(extended) >= length else following
                key = extended[:length]
                bucket[key] = bucket.get(key, 0.0) + probability * p_emitted
        frontier = following
    return finished


def toy_pair(order: int, vocab: int, variant: str, seed: int = 0) -> tuple[Warped, Warped]:
    sampling = SAMPLING_VARIANTS[variant]
    target = Warped(random_markov(vocab, order, seed=1000 + seed), sampling)
    draft = Warped(random_markov(vocab, order, seed=2000 + seed, sharpness=2.5), sampling)
    return target, draft


def fidelity_error(
    method: str, shape: Sequence[int], order: int, variant: str, length: int = 3, **kw
) -> float:
    target, draft = toy_pair(order, 4, variant)
    got = exact_output_distribution(method, shape, target, draft, length, **kw)
    assert abs(sum(got.values()) - 1.0) < TOLERANCE
    return max_abs_difference(got, target.sequence_distribution(length))


VARIANTS = list(SAMPLING_VARIANTS)

# (method, shape, order): sequence methods at k = 3 on order 1 and k = 2 on order 2.
SEQUENCE_CASES = [
    (method, sequence_shape(k), order)
    for method in ("token", "block", "gsd-tree")
    for order, k in ((1, 3), (2, 2))
]
TREE_SHAPES = {
    "star3": (-1, -1, -1),
    "two-level": (-1, -1, 0),
    "two-level-wide": (-1, -1, 0, 0, 1),
}
RD_SETTINGS = [(0.0, 2), (1.0, 2), (0.5, 1), (0.5, 2), (0.5, 3), (0.3, 2)]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize(("method", "shape", "order"), SEQUENCE_CASES, ids=lambda v: str(v))
def test_sequence_methods_exact(method: str, shape: tuple[int, ...], order: int, variant: str) -> None:
    assert fidelity_error(method, shape, order, variant) < TOLERANCE


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("order", [1, 2])
@pytest.mark.parametrize("shape_name", ["star3", "two-level"])
def test_gsd_tree_exact(shape_name: str, order: int, variant: str) -> None:
    assert fidelity_error("gsd-tree", TREE_SHAPES[shape_name], order, variant) < TOLERANCE


@pytest.mark.slow
@pytest.mark.parametrize("variant", VARIANTS)
def test_gsd_wide_tree_exact(variant: str) -> None:
    assert fidelity_error("gsd-tree", TREE_SHAPES["two-level-wide"], 1, variant) < TOLERANCE


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("order", [1, 2])
@pytest.mark.parametrize(("a", "k_max"), RD_SETTINGS)
def test_rd_exact(a: float, k_max: int, order: int, variant: str) -> None:
    assert fidelity_error("rd", (), order, variant, a=a, k_max=k_max) < TOLERANCE


def test_terrible_drafter_and_longer_output() -> None:
    """A drafter with most mass where the target has least, L = 4, vocabulary 5."""
    from .toy_models import anti_model

    target_model = random_markov(5, 1, seed=7)
    target = Warped(target_model)
    draft = Warped(anti_model(target_model))
    expected = target.sequence_distribution(4)
    for method in ("token", "block"):
        got = exact_output_distribution(method, sequence_shape(2), target, draft, 4)
        assert max_abs_difference(got, expected) < TOLERANCE


def _sign_error_residual(p: torch.Tensor, q: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    diff = (q - scale * p).clamp_min(0.0)
    return diff / diff.sum()


def _resample_target_residual(p: torch.Tensor, q: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    return p / p.sum()


@pytest.mark.parametrize("broken", [_sign_error_residual, _resample_target_residual])
@pytest.mark.parametrize("module_name", ["token", "block", "gsd_tree", "rd"])
def test_broken_residual_is_caught(monkeypatch: pytest.MonkeyPatch, module_name: str, broken) -> None:
    import importlib

    module = importlib.import_module(f"specdec.verification.{module_name}")
    monkeypatch.setattr(module, "residual", broken)
    method = {"gsd_tree": "gsd-tree"}.get(module_name, module_name)
    kwargs = {"a": 0.5, "k_max": 2} if method == "rd" else {}
    assert fidelity_error(method, sequence_shape(2), 1, "T=1", **kwargs) > 1e-3


def test_broken_acceptance_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Accepting with p/q uncapped-then-capped differently (here: always accept) must fail too."""
    monkeypatch.setattr(token_module, "acceptance", lambda p, q: 1.0 if p > 0 else 0.0)
    assert fidelity_error("token", sequence_shape(2), 1, "T=1") > 1e-3


# --- the paper's toy: expected accepted draft tokens -------------------------------------------


def _expected_accepted(method: str) -> float:
    target = Warped(constant_model([1 / 3, 2 / 3]))
    draft = Warped(constant_model([2 / 3, 1 / 3]))

    def accepted(source: RandomSource) -> int:
        tree, _ = draft_tree(sequence_shape(2), lambda path: draft.probs(path), "sample", source)
        contexts = [[]] + [tree.path_tokens(i) for i in range(len(tree))]
        result = verify(
            method, tree, target.rows_for(contexts), draft.rows_for(contexts), MethodParams(), source
        )
        return result.num_accepted

    return expectation(enumerate_outcomes(accepted), float)


def test_block_paper_toy_values() -> None:
    assert _expected_accepted("block") == pytest.approx(11 / 9, abs=1e-14)
    assert _expected_accepted("token") == pytest.approx(10 / 9, abs=1e-14)
    assert _expected_accepted("gsd-tree") == pytest.approx(10 / 9, abs=1e-14)


# --- ERSD: exact through the race-decoding identity --------------------------------------------


def _race_decode(target: Warped, seed: int, length: int) -> list[int]:
    out: list[int] = []
    for n in range(length):
        out.append(race_winner(race(seed, n, target.vocab), target.probs(out)))
    return out


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("order", [1, 2])
@pytest.mark.parametrize("shape_name", ["sequence3", "star3", "two-level-wide"])
def test_ersd_equals_race_decoding(shape_name: str, order: int, variant: str) -> None:
    """ERSD is exact: its output IS target-only race decoding, whose distribution is the target's.

    Why this is exact, not approximate: (1) for every realisation of the races, ERSD's output
    equals target-only race decoding (argmin e_n/P_n at every position n) — at each node the
    emitted token is the race winner under P whatever the drafter proposed; the drafts only
    decide how many of those tokens one iteration confirms. This test checks that identity token
    for token on the same toys and warpings as the enumerated methods (tests/core/
    test_ersd_identity.py checks it far more broadly). (2) Races at different positions are
    independent Exp(1) vectors, and argmin_x e(x)/P(x) over independent exponentials picks x
    with probability exactly P(x) (the minimum of independent Exp(rate P(x)) variables); so
    race decoding samples the sequence with probability Π_n P_n(x_n) — exactly the target's
    sequence distribution. Step (2) is a property of the exponential distribution; the race
    generator's distribution is checked statistically in test_ersd_identity.py.
    """
    shape = {"sequence3": sequence_shape(3)}.get(shape_name) or TREE_SHAPES[shape_name]
    target, draft = toy_pair(order, 4, variant)
    for seed in range(20):
        out: list[int] = []
        while len(out) < 6:
            out.extend(one_iteration("ersd", shape, target, draft, out, None, strategy="race", seed=seed))  # type: ignore[arg-type]
        assert out == _race_decode(target, seed, len(out))

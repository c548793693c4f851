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

import pytest
import torch

from specdec.drafting import draft_tree
from specdec.races import race, race_winner
from specdec.randomness import RandomSource
from specdec.verification import token as token_module
from specdec.verification.base import MethodParams
from specdec.verification.dispatch import verify
from specdec.verification.rd import leading_heads

from .helpers_enumeration import EnumerationError, enumerate_outcomes, expectation, max_abs_difference
from .helpers_fidelity import (
    TOLERANCE,
    exact_output_distribution,
    fidelity_error,
    one_iteration,
    sequence_shape,
    toy_pair,
)
from .helpers_toy_models import SAMPLING_VARIANTS, Warped, constant_model, random_markov

VARIANTS = list(SAMPLING_VARIANTS)

# (method, shape, order): sequence methods at k = 3 on order 1 and k = 2 on order 2.
# Block verification gets k = 3 on order 1 (its joint decision over a longer block is the point);
# token and gsd-tree k = 2 (gsd-tree on sequences is also checked equal to token verification).
SEQUENCE_CASES = [
    ("block", sequence_shape(3), 1),
    ("block", sequence_shape(2), 2),
    ("token", sequence_shape(2), 1),
    ("token", sequence_shape(2), 2),
    ("gsd-tree", sequence_shape(2), 1),
    ("gsd-tree", sequence_shape(2), 2),
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


# Every setting on order 1; the order-2 toy with a = 0, a = 1 and a = 0.5 at k_max = 2.
RD_CASES = [(a, k_max, 1) for a, k_max in RD_SETTINGS] + [(0.0, 2, 2), (1.0, 2, 2), (0.5, 2, 2)]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize(("a", "k_max", "order"), RD_CASES)
def test_rd_exact(a: float, k_max: int, order: int, variant: str) -> None:
    assert fidelity_error("rd", (), order, variant, a=a, k_max=k_max) < TOLERANCE


@pytest.mark.parametrize("method", ["token", "block", "gsd-tree"])
@pytest.mark.parametrize(("vocab", "k", "variant"), [(6, 2, "T=0.7,top-k=3"), (8, 1, "T=1")])
def test_larger_vocabularies_exact(method: str, vocab: int, k: int, variant: str) -> None:
    assert fidelity_error(method, sequence_shape(k), 1, variant, vocab=vocab) < TOLERANCE


def test_terrible_drafter_and_longer_output() -> None:
    """A drafter with most mass where the target has least, L = 4, vocabulary 5."""
    from .helpers_toy_models import anti_model

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


def test_block_residual_without_its_weight_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Block verification's residual must use w_τ·P − Q; the token residual there is wrong."""
    from specdec.verification import base
    from specdec.verification import block as block_module

    monkeypatch.setattr(block_module, "residual", lambda p, q, scale=1.0: base.residual(p, q))
    assert fidelity_error("block", sequence_shape(2), 1, "T=1") > 1e-3


def test_broken_acceptance_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Accepting with p/q uncapped-then-capped differently (here: always accept) must fail too."""
    monkeypatch.setattr(token_module, "acceptance", lambda p, q: 1.0 if p > 0 else 0.0)
    assert fidelity_error("token", sequence_shape(2), 1, "T=1") > 1e-3


# --- the enumerator itself ----------------------------------------------------------------------


def test_enumerator_coins_and_skipped_zero_branches() -> None:
    runs = []

    def two_coins(source: RandomSource) -> int:
        runs.append(1)
        return int(source.bernoulli(0.3)) + int(source.bernoulli(0.3)) + int(source.bernoulli(1.0))

    assert enumerate_outcomes(two_coins) == pytest.approx({1: 0.49, 2: 0.42, 3: 0.09}, abs=1e-15)
    assert len(runs) == 4  # p = 1 (and p = 0) consume no draw, like TorchRandomSource
    runs.clear()
    dist = enumerate_outcomes(lambda s: runs.append(1) or s.categorical(torch.tensor([0.5, 0.0, 0.25, 0.25])))
    assert dist == pytest.approx({0: 0.5, 2: 0.25, 3: 0.25}, abs=1e-15) and len(runs) == 3


def test_enumerator_follows_branch_dependent_draws() -> None:
    """The number and kind of later draws depend on earlier answers."""

    def walk(source: RandomSource) -> tuple[int, ...]:
        first = source.categorical(torch.tensor([0.2, 0.8], dtype=torch.float64))
        if first == 0:
            return (0, source.categorical(torch.tensor([0.5, 0.5])))
        return (1, int(source.bernoulli(0.25)), int(source.bernoulli(0.5)))

    expected = {(0, 0): 0.1, (0, 1): 0.1, (1, 1, 1): 0.1, (1, 1, 0): 0.1, (1, 0, 1): 0.3, (1, 0, 0): 0.3}
    assert enumerate_outcomes(walk) == pytest.approx(expected, abs=1e-15)


def test_enumerator_agrees_with_the_torch_source() -> None:
    """Same semantics as the production source: chi-square of 8000 seeded draws."""
    from scipy.stats import chisquare

    from specdec.randomness import TorchRandomSource

    def outcome(source: RandomSource) -> int:
        return leading_heads(0.6, 3, source) * 10 + source.categorical(
            torch.tensor([0.7, 0.2, 0.1], dtype=torch.float64)
        )

    exact = enumerate_outcomes(outcome)
    source = TorchRandomSource.from_seed(0, "enumerator-check")
    counts = dict.fromkeys(exact, 0)
    for _ in range(8000):
        counts[outcome(source)] += 1
    keys = sorted(exact)
    observed = [counts[key] for key in keys]
    assert chisquare(observed, [exact[key] * 8000 for key in keys]).pvalue > 1e-3


def test_enumerator_rejects_what_it_cannot_follow() -> None:
    with pytest.raises(EnumerationError, match="sum to 1"):
        enumerate_outcomes(lambda s: s.categorical(torch.tensor([0.5, 0.2])))
    with pytest.raises(EnumerationError, match=">= 0"):
        enumerate_outcomes(lambda s: s.categorical(torch.tensor([1.5, -0.5])))
    with pytest.raises(EnumerationError, match="NaN"):
        enumerate_outcomes(lambda s: s.bernoulli(float("nan")))
    with pytest.raises(EnumerationError, match="more than"):
        enumerate_outcomes(lambda s: sum(s.bernoulli(0.5) for _ in range(10)), max_runs=100)
    calls = iter(range(100))

    def nondeterministic(source: RandomSource) -> int:
        return source.categorical(torch.tensor([0.5, 0.5] if next(calls) == 0 else [1.0]))

    with pytest.raises(EnumerationError, match="not deterministic"):
        enumerate_outcomes(nondeterministic)


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

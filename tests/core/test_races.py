"""Tests for specdec.races: reproducible position-keyed Exp(1) races and their winners/arrivals."""

from __future__ import annotations

import hashlib
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from specdec.races import _exponentials as races_exponentials
from specdec.races import _raw as races_raw
from specdec.races import race, race_arrivals, race_scores, race_winner, race_winner_at, sole_support

ROOT = Path(__file__).resolve().parents[2]


def _digest(e: torch.Tensor) -> str:
    return hashlib.sha256(e.numpy().tobytes()).hexdigest()


def test_race_is_reproducible_across_calls_and_processes():
    e = race(1234, 17, 1000)
    assert e.dtype == torch.float64 and e.shape == (1000,)
    assert torch.equal(e, race(1234, 17, 1000))
    code = (
        "import hashlib; from specdec.races import race; "
        "print(hashlib.sha256(race(1234, 17, 1000).numpy().tobytes()).hexdigest())"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == _digest(e)


def test_race_of_a_larger_vocabulary_extends_the_smaller_one():
    # raw_j is the j-th output of the position's stream, so the vocabulary only truncates it
    assert torch.equal(race(5, 3, 64), race(5, 3, 200)[:64])


def test_different_positions_and_seeds_give_unrelated_races():
    base = race(7, 0, 4096)
    others = [race(7, 1, 4096), race(7, 2**40, 4096), race(8, 0, 4096), race(-7, 0, 4096)]
    for other in others:
        assert not torch.any(base == other)
        rho = stats.spearmanr(base.numpy(), other.numpy()).statistic
        assert abs(rho) < 0.08  # ~5 standard deviations of 1/sqrt(4096)
    with pytest.raises(ValueError):
        race(7, -1, 10)


def test_race_values_are_exp1():
    n = 200_000
    e = race(99, 3, n).numpy()
    assert np.all(e > 0) and np.all(np.isfinite(e))
    assert abs(e.mean() - 1) < 5 / math.sqrt(n)
    assert abs(e.var() - 1) < 5 * math.sqrt(8 / n)  # Var of the sample variance of Exp(1) ≈ 8/n
    assert stats.kstest(e, "expon").pvalue > 1e-4
    # pooled over positions too (independent streams)
    pooled = np.concatenate([race(99, pos, 50).numpy() for pos in range(2000)])
    assert stats.kstest(pooled, "expon").pvalue > 1e-4


def test_winner_is_distributed_as_d_and_zero_probability_never_wins():
    dist = torch.tensor([0.05, 0.3, 0.0, 0.15, 0.4, 0.1], dtype=torch.float64)
    n = 8_000
    counts = np.zeros(6)
    for pos in range(n):
        counts[race_winner(race(2024, pos, 6), dist)] += 1
    assert counts[2] == 0
    support = dist.numpy() > 0
    chi2 = stats.chisquare(counts[support], n * dist.numpy()[support])
    assert chi2.pvalue > 1e-4


def test_first_two_arrivals_are_a_sample_without_replacement():
    # Plackett–Luce: Pr(first = x, second = y) = D(x)·D(y)/(1 − D(x))
    dist = np.array([0.1, 0.2, 0.3, 0.4])
    n = 8_000
    counts = {}
    for pos in range(n):
        pair = tuple(race_arrivals(race(77, pos, 4), torch.tensor(dist), 2))
        counts[pair] = counts.get(pair, 0) + 1
    pairs = [(x, y) for x in range(4) for y in range(4) if x != y]
    observed = np.array([counts.get(p, 0) for p in pairs])
    expected = np.array([n * dist[x] * dist[y] / (1 - dist[x]) for x, y in pairs])
    assert observed.sum() == n
    assert stats.chisquare(observed, expected).pvalue > 1e-4


@settings(max_examples=100, deadline=None)
@given(seed=st.integers(-(2**62), 2**62), position=st.integers(0, 2**40), data=st.data())
def test_arrivals_are_distinct_ordered_and_start_with_the_winner(seed, position, data):
    vocab = data.draw(st.integers(1, 40))
    weight = st.one_of(st.just(0.0), st.floats(1e-6, 1.0))
    dist = torch.tensor(data.draw(st.lists(weight, min_size=vocab, max_size=vocab)), dtype=torch.float64)
    e = race(seed, position, vocab)
    m = data.draw(st.integers(0, vocab + 2))
    arrivals = race_arrivals(e, dist, m)
    support = int((dist > 0).sum())
    assert len(arrivals) == min(m, support)
    assert len(set(arrivals)) == len(arrivals)
    assert all(dist[x] > 0 for x in arrivals)
    scores = race_scores(e, dist)
    assert all(scores[a] <= scores[b] for a, b in zip(arrivals, arrivals[1:], strict=False))
    # they are the m smallest arrival times
    finite = sorted(float(s) for s in scores if math.isfinite(float(s)))
    assert [float(scores[a]) for a in arrivals] == finite[: len(arrivals)]
    if support:
        winner = race_winner(e, dist)
        assert dist[winner] > 0
        assert winner == race_arrivals(e, dist, 1)[0]
        d = dist.numpy()
        assert winner == int(np.argmin(np.where(d > 0, e.numpy() / np.where(d > 0, d, 1.0), np.inf)))
    else:
        assert arrivals == []


def test_scores_are_infinite_exactly_off_the_support():
    e = race(1, 1, 5)
    dist = torch.tensor([0.0, 0.5, 0.0, 0.5, 0.0], dtype=torch.float32)
    scores = race_scores(e, dist)
    assert scores.dtype == torch.float64
    assert torch.isinf(scores[[0, 2, 4]]).all() and torch.isfinite(scores[[1, 3]]).all()
    assert race_arrivals(e, dist, 0) == []
    assert sorted(race_arrivals(e, dist, 10)) == [1, 3]


def _reference_race(seed: int, position: int, vocab: int) -> torch.Tensor:
    """The race as its module docstring writes it, out of place (the formula the fast path keeps)."""
    from specdec.randomness import derive_seed

    raw = np.random.Philox(key=derive_seed(seed, "race"), counter=[0, 0, position, 0]).random_raw(vocab)
    uniform = ((raw >> np.uint64(11)).astype(np.float64) + 0.5) * (1.0 / 9007199254740992.0)
    return torch.from_numpy(-np.log(uniform))


@pytest.mark.parametrize(("seed", "position", "vocab"), [(0, 0, 1), (1234, 17, 1000), (2**62, 10**6, 151936)])
def test_race_equals_the_docstring_formula_bitwise(seed, position, vocab):
    assert torch.equal(race(seed, position, vocab), _reference_race(seed, position, vocab))


def test_sole_support_names_the_token_of_a_greedy_row_and_agrees_with_the_race():
    for token in (0, 7, 999):
        row = torch.zeros(1000)
        row[token] = 1.0
        assert sole_support(row) == token
        assert sole_support(row.double()) == token
        assert race_winner(race(5, token, 1000), row) == token
    assert sole_support(torch.full((10,), 0.1)) is None  # two or more positive entries: race it
    assert sole_support(torch.tensor([0.0, 0.5, 0.5])) is None
    assert sole_support(torch.zeros(4)) is None  # no mass: the race reports it
    assert sole_support(torch.tensor([0.0, 1e-310, 0.0], dtype=torch.float64)) is None  # e / D may overflow


def _reference_winner(seed: int, position: int, dist: torch.Tensor) -> int | None:
    """The winner as ERSD picked it before race_winner_at: every token scored in torch."""
    scores = race_scores(race(seed, position, dist.shape[-1]), dist)
    token = int(torch.argmin(scores).item())
    return token if bool(torch.isfinite(scores[token])) else None


def _lm_like(rng: np.random.Generator, vocab: int, spread: float, zeros: float = 0.0) -> torch.Tensor:
    """A softmax of Gumbel-ish logits: a few likely tokens and a long tail (spread: the logits' scale),
    some entries set to 0 (top-k / top-p) and the rest in float32, as warped target rows are."""
    logits = rng.standard_normal(vocab) * spread
    probs = np.exp(logits - logits.max())
    if zeros:
        probs[rng.random(vocab) < zeros] = 0.0
    probs /= probs.sum()
    return torch.from_numpy(probs.astype(np.float32))


@pytest.mark.parametrize("spread", [0.5, 2.0, 4.0, 8.0])
@pytest.mark.parametrize("zeros", [0.0, 0.5])
def test_race_winner_at_is_the_winner_of_the_whole_race(spread: float, zeros: float) -> None:
    """Peaked rows (the pruned path), flat ones (every token scored), rows with zeros: the same token
    as scoring every token, for 150 (seed, position) pairs each at the default vocabulary's size."""
    rng = np.random.default_rng(int(spread * 10 + zeros * 100))
    for i in range(150):
        dist = _lm_like(rng, 151_936 if i % 10 == 0 else 5_000, spread, zeros)
        seed, position = int(rng.integers(0, 2**62)), int(rng.integers(0, 4096))
        assert race_winner_at(seed, position, dist) == _reference_winner(seed, position, dist)


def test_race_winner_at_scores_few_tokens_on_a_peaked_row(monkeypatch) -> None:
    """On a peaked row it never builds the whole race (race() is not called) yet names its winner;
    a row without positive mass has none."""
    rng = np.random.default_rng(3)
    dists = [_lm_like(rng, 151_936, 6.0) for _ in range(20)]
    expected = [_reference_winner(7, 100 + i, d) for i, d in enumerate(dists)]
    import specdec.races as races

    monkeypatch.setattr(races, "race", lambda *args: pytest.fail("the whole race was built"))
    assert [race_winner_at(7, 100 + i, d) for i, d in enumerate(dists)] == expected
    assert race_winner_at(7, 0, torch.zeros(50)) is None


def test_a_light_token_at_the_bound_is_kept() -> None:
    """The bound's edge: a light token (D = HEAVY) against one heavy token, their scores 1e-12 apart
    either way, which puts the light token's uniform within a few 2**-53 steps of the bound. Both
    answers match the whole race (the negative case: a bound a million steps too high drops the
    light winner; checked by hand)."""
    from specdec.races import HEAVY

    vocab = 4096
    for seed, position in ((11, 5), (12, 9), (13, 700)):
        e = race(seed, position, vocab).numpy()
        light = int(np.argmin(e))
        heavy = int(np.argmax(e))
        for nudge, winner in ((1.0 - 1e-12, light), (1.0 + 1e-12, heavy)):
            dist = torch.zeros(vocab, dtype=torch.float64)
            dist[light] = HEAVY
            dist[heavy] = e[heavy] * HEAVY / e[light] * nudge
            assert dist[heavy] > HEAVY
            assert race_winner_at(seed, position, dist) == _reference_winner(seed, position, dist) == winner


def test_the_exponentials_of_a_subset_are_those_of_the_whole_race() -> None:
    """race_winner_at scores a subset of tokens with the same numpy arithmetic as `race`; on this
    machine the values are bitwise the ones of the whole vector (numpy's log takes one path)."""
    rng = np.random.default_rng(5)
    for position in range(20):
        whole = race(99, position, 151_936).numpy()
        index = np.sort(rng.choice(151_936, size=int(rng.integers(1, 2000)), replace=False))
        assert np.array_equal(races_exponentials(races_raw(99, position, 151_936)[index]), whole[index])

"""Checks of specdec.theory against the papers' numbers, hand computations and brute force."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from scipy.integrate import quad

from specdec import theory as T
from specdec.trees import expected_accepted, optimal_tree_shape


def _pair(rng: np.random.Generator, v: int, conc: float = 0.5, rows: int | None = None):
    shape = (v,) if rows is None else (rows, v)
    size = None if rows is None else rows
    p = rng.dirichlet(np.full(v, conc), size=size).reshape(shape)
    q = rng.dirichlet(np.full(v, conc), size=size).reshape(shape)
    return p, q


# ---------------------------------------------------------------------------------------------
# sequence drafting: the table of speculative-decoding-math.txt ("Optimal draft length for
# different configurations", k searched over 1..20)
# ---------------------------------------------------------------------------------------------
PAPER_TABLE = [
    (0.6, 10, 3, 1.67), (0.6, 20, 4, 1.92), (0.6, 50, 6, 2.17),
    (0.7, 10, 4, 1.98), (0.7, 20, 6, 2.35), (0.7, 50, 8, 2.76),
    (0.8, 10, 6, 2.47), (0.8, 20, 8, 3.09), (0.8, 50, 11, 3.82),
    (0.9, 10, 10, 3.43), (0.9, 20, 13, 4.67), (0.9, 50, 19, 6.37),
]


@pytest.mark.parametrize(("alpha", "c", "k_star", "s_star"), PAPER_TABLE)
def test_best_k_matches_paper_table(alpha, c, k_star, s_star):
    k, s = T.best_k(alpha, c, k_max=20)
    assert k == k_star
    assert round(s, 2) == s_star


def test_speedup_hand_computed():
    # α = 0.8, k = 8: E = (1 − 0.8^9)/0.2 = (1 − 0.134217728)/0.2 = 4.32891136; S = E/(1 + 8/20) = E/1.4
    assert T.expected_tokens_per_iteration(0.8, 8) == pytest.approx(4.32891136, rel=1e-14)
    assert T.speedup(0.8, 8, 20) == pytest.approx(4.32891136 / 1.4, rel=1e-14)
    assert T.best_k(0.3, 2.0, k_max=10, k_min=0) == (0, 1.0)  # speculation does not pay


def test_expected_tokens_edges_and_direct_sum():
    rng = np.random.default_rng(0)
    for _ in range(50):
        alpha, k = float(rng.uniform()), int(rng.integers(0, 30))
        direct = sum(alpha**i for i in range(k + 1))
        assert T.expected_tokens_per_iteration(alpha, k) == pytest.approx(direct, rel=1e-12)
    assert T.expected_tokens_per_iteration(1.0, 7) == 8.0
    assert T.expected_tokens_per_iteration(0.0, 7) == 1.0
    # accurate as α → 1 (the naive closed form loses ~6 digits here)
    eps = 1e-12
    assert T.expected_tokens_per_iteration(1 - eps, 10) == pytest.approx(11 - 55 * eps, rel=1e-14)
    with pytest.raises(ValueError):
        T.expected_tokens_per_iteration(1.2, 3)
    with pytest.raises(ValueError):
        T.expected_tokens_per_iteration(0.5, -1)
    with pytest.raises(ValueError):
        T.speedup(0.5, 3, 0.0)


# ---------------------------------------------------------------------------------------------
# divergences
# ---------------------------------------------------------------------------------------------
def test_divergences_on_random_pairs():
    rng = np.random.default_rng(1)
    p, q = _pair(rng, 40, rows=30)
    alpha = T.acceptance_rate(p, q)
    assert alpha.shape == (30,)
    np.testing.assert_allclose(alpha, 1 - T.total_variation(p, q), atol=1e-14)
    d_hm = T.harmonic_mean_divergence(p, q)
    # min(p,q)/2 <= p q/(p+q) <= min(p,q) termwise
    assert np.all(d_hm <= alpha + 1e-15)
    assert np.all(d_hm >= alpha / 2 - 1e-15)
    kl = T.kl_divergence(p, q)
    assert np.all(kl >= 0)
    np.testing.assert_allclose(T.cross_entropy(p, q), T.entropy(p) + kl, rtol=1e-12)
    assert T.kl_divergence(p[0], p[0]) == pytest.approx(0.0, abs=1e-15)


def test_divergences_hand_values_and_edge_cases():
    v = 8
    u = np.full(v, 1 / v)
    assert T.entropy(u) == pytest.approx(math.log(v))
    assert T.second_log_moment(u) == pytest.approx(math.log(v) ** 2)
    p = np.array([0.5, 0.5, 0.0])
    q = np.array([0.0, 0.5, 0.5])
    assert T.harmonic_mean_divergence(p, q) == pytest.approx(0.25)  # 0/0 → 0, 0.25/1 = 0.25
    assert T.acceptance_rate(p, q) == pytest.approx(0.5)
    assert T.kl_divergence(p, q) == math.inf
    assert T.cross_entropy(p, q) == math.inf
    assert T.kl_divergence(q[[1, 2, 0]], np.array([0.5, 0.5, 0.0])) == pytest.approx(0.0)
    # torch float32 input and batch shapes give the same numbers as numpy float64
    rng = np.random.default_rng(2)
    a, b = _pair(rng, 16, rows=6)
    a32 = torch.tensor(a.reshape(2, 3, 16), dtype=torch.float32)
    got = T.total_variation(a32, torch.tensor(b.reshape(2, 3, 16)))
    assert got.shape == (2, 3)
    np.testing.assert_allclose(got.ravel(), T.total_variation(a, b), atol=1e-6)
    with pytest.raises(ValueError):
        T.total_variation(a, b[:, :8])


def test_entropy_moments_and_drafter_cross_entropy():
    p = np.array([[0.5, 0.5, 0.0, 0.0], [0.25, 0.25, 0.25, 0.25]])
    mu, mu2 = T.entropy_moments(p)
    assert mu == pytest.approx((math.log(2) + math.log(4)) / 2)
    assert mu2 == pytest.approx((math.log(2) ** 2 + math.log(4) ** 2) / 2)
    q = np.array([[1.0, 0.0, 0.0, 0.0], [0.5, 0.5, 0.0, 0.0]])
    mu_ce, zero = T.drafter_cross_entropy(p, q)
    # row 1: inside q>0 only token 0: −0.5 ln 1 / 0.5 = 0; row 2: −(0.25 ln .5)·2 / 0.5 = ln 2
    assert mu_ce == pytest.approx(math.log(2) / 2)
    assert zero == pytest.approx((0.5 + 0.5) / 2)


# ---------------------------------------------------------------------------------------------
# ERSD first-token acceptance (Lemma 3.1)
# ---------------------------------------------------------------------------------------------
def test_ersd_acceptance_formula_matches_brute_force_and_lemma_3_1():
    rng = np.random.default_rng(3)
    for trial in range(30):
        v = int(rng.integers(2, 9))
        p, q = _pair(rng, v, conc=float(rng.uniform(0.2, 2)))
        if trial % 3 == 0:
            p[0], q[-1] = 0.0, 0.0
            p, q = p / p.sum(), q / q.sum()
        brute = sum(
            1.0 / sum(max(p[y] / p[x], q[y] / q[x]) for y in range(v))
            for x in range(v) if p[x] > 0 and q[x] > 0
        )
        got = T.ersd_acceptance(p, q)
        assert got == pytest.approx(brute, rel=1e-12, abs=1e-15)
        assert T.harmonic_mean_divergence(p, q) - 1e-12 <= got <= T.acceptance_rate(p, q) + 1e-12


def test_ersd_acceptance_matches_exponential_races_statistically():
    rng = np.random.default_rng(4)
    p = np.array([0.4, 0.3, 0.2, 0.1, 0.0])
    q = np.array([0.1, 0.2, 0.3, 0.2, 0.2])
    n = 200_000
    e = rng.exponential(size=(n, 5))
    with np.errstate(divide="ignore"):
        match = np.mean(np.argmin(e / p, axis=1) == np.argmin(e / q, axis=1))
    exact = T.ersd_acceptance(p, q)
    sd = math.sqrt(exact * (1 - exact) / n)
    assert abs(match - exact) < 5 * sd


# ---------------------------------------------------------------------------------------------
# randomised drafting
# ---------------------------------------------------------------------------------------------
def test_rd_acceptance_matches_lemma_4_1_and_is_decreasing():
    rng = np.random.default_rng(5)
    p, q = _pair(rng, 30, rows=12)
    grid = np.linspace(0.01, 1.0, 100)
    curve = T.rd_acceptance_curve(p, q, grid)
    paper = [(1 + a - np.abs(p - a * q).sum(axis=1).mean()) / (2 * a) for a in grid]
    np.testing.assert_allclose(curve, paper, atol=1e-12)
    assert np.all(np.diff(curve) <= 1e-13)
    assert T.rd_acceptance(p, q, 1.0) == pytest.approx(float(np.mean(T.acceptance_rate(p, q))), abs=1e-14)
    assert T.rd_acceptance(p, q, 0.37) == pytest.approx(curve[np.argmin(abs(grid - 0.37))], abs=1e-14)


def test_rd_acceptance_small_a_limit():
    p = np.array([0.5, 0.3, 0.2, 0.0])
    q = np.array([0.1, 0.2, 0.3, 0.4])
    # for a <= min p/q over q>0, p>0 (here 0.2/0.3) every drafted token with p > 0 is accepted
    assert T.rd_acceptance(p, q, 0.0) == pytest.approx(0.6)
    assert T.rd_acceptance(p, q, 1e-9) == pytest.approx(0.6, abs=1e-15)
    # a = .8 > 2/3: x2 is accepted w.p. p/(a q), i.e. contributes min(q, p/a) = .2/.8
    assert T.rd_acceptance(p, q, 0.8) == pytest.approx(0.1 + 0.2 + 0.2 / 0.8)
    with pytest.raises(ValueError):
        T.rd_acceptance(p, q, 1.5)


def _brute_force_best(p, q, lam):
    """Objective at 0, 1, every breakpoint p/q in [0, 1] and a dense grid."""
    p2, q2 = np.atleast_2d(p), np.atleast_2d(q)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratios = (p2 / q2)[q2 > 0]
    cands = np.concatenate([[0.0, 1.0], ratios[(ratios >= 0) & (ratios <= 1)], np.linspace(0, 1, 2001)])
    objs = np.array([np.abs(p2 - a * q2).sum(axis=1).mean() + a * (2 * lam - 1) for a in cands])
    return cands, objs


def test_best_a_is_the_exact_minimiser_on_random_rows():
    rng = np.random.default_rng(6)
    seen = {"zero": 0, "one": 0, "interior": 0}
    for trial in range(60):
        v = int(rng.integers(2, 12))
        rows = int(rng.integers(1, 6))
        p, q = _pair(rng, v, conc=float(rng.uniform(0.1, 3)), rows=rows)
        if trial % 4 == 0:  # zero target mass where the drafter has some: ratios exactly 0
            p[:, 0] = 0.0
            p /= p.sum(axis=1, keepdims=True)
        lam = float(rng.choice([0.0, 0.05, 0.2, 0.5, 0.8, 0.95, 1.0, 1.3]))
        a_star, obj = T.best_a(p, q, lam)
        cands, objs = _brute_force_best(p, q, lam)
        assert 0.0 <= a_star <= 1.0
        assert obj == pytest.approx(T.rd_objective(p, q, a_star, lam), abs=1e-13)
        assert obj <= objs.min() + 1e-12
        seen["zero" if a_star == 0 else "one" if a_star == 1 else "interior"] += 1
    assert all(n > 0 for n in seen.values()), seen


def test_best_a_hand_example_interior_one_and_zero():
    # p = (.5, .3, .2), q = (.2, .3, .5): on [0, .4] the objective is 1 + a(2λ − 2); on [.4, 1] it is
    # .6 + a(2λ − 1). For λ in (.5, 1) the minimum is at the breakpoint a = .2/.5 = .4.
    p = np.array([0.5, 0.3, 0.2])
    q = np.array([0.2, 0.3, 0.5])
    a_star, obj = T.best_a(p, q, 0.75)
    assert a_star == pytest.approx(0.4, abs=1e-15)
    assert obj == pytest.approx(0.6 + 0.4 * 0.5)
    a_star, obj = T.best_a(p, q, 0.25)  # right slope 2λ − 1 < 0: a = 1, objective .6 + (2·.25 − 1) = .1
    assert (a_star, obj) == (1.0, pytest.approx(0.1))
    a_star, obj = T.best_a(p, q, 1.2)  # λ > 1: drafting never pays
    assert (a_star, obj) == (0.0, pytest.approx(1.0))
    # disjoint supports: every ratio is 0, any λ > 0 makes a = 0 optimal
    a_star, _ = T.best_a(np.array([0.5, 0.5, 0, 0]), np.array([0, 0, 0.5, 0.5]), 0.1)
    assert a_star == 0.0
    # λ = 1: the objective is flat on [0, smallest ratio]; the LARGEST minimiser is returned
    rng = np.random.default_rng(7)
    p, q = _pair(rng, 20, conc=1.0)
    assert T.best_a(p, q, 1.0)[0] == pytest.approx(float(np.min(p / q)), rel=1e-15)
    # p = q: a = 1 (vanilla SD is already perfect) unless λ > 1
    assert T.best_a(p, p, 0.9)[0] == 1.0


def test_best_a_handles_a_large_vocabulary_through_the_refinement_path(monkeypatch):
    rng = np.random.default_rng(8)
    p, q = _pair(rng, 1000, conc=0.1, rows=6)
    p[:, :150] = 0.0
    p /= p.sum(axis=1, keepdims=True)
    exact = [T.best_a(p, q, lam) for lam in (0.1, 0.3, 0.6)]
    original = T._upper_weighted_quantile
    monkeypatch.setattr(T, "_upper_weighted_quantile",
                        lambda pr, qr, tau: original(pr, qr, tau, collect_cap=64, bins=8))
    passes = []
    original_scan = T._ratio_weights
    monkeypatch.setattr(T, "_ratio_weights", lambda *args: passes.append(1) or original_scan(*args))
    refined = [T.best_a(p, q, lam) for lam in (0.1, 0.3, 0.6)]
    assert refined == exact
    assert len(passes) > 3 * 4  # several histogram passes per call, not one direct sort
    for (_, obj), lam in zip(exact, (0.1, 0.3, 0.6), strict=True):
        _, objs = _brute_force_best(p, q, lam)
        assert obj <= objs.min() + 1e-12


def _paper_tps_gain(p, q, a, lam):
    """Toner et al. eq. 5 (k = 1, T_p = 1): TPS_RD(a) − TPS_SD, α(a) from rd_acceptance_curve."""
    a = np.atleast_1d(np.asarray(a, dtype=np.float64))
    alpha1 = T.rd_acceptance(p, q, 1.0)
    a_alpha = a * T.rd_acceptance_curve(p, q, a)
    return (a_alpha + a - alpha1 - 1) / (1 + lam) + 1 - a


def test_lemma_4_3_consistency_with_best_a():
    rng = np.random.default_rng(9)
    grid = np.linspace(0, 1, 2001)
    for _ in range(25):
        p, q = _pair(rng, 10, conc=float(rng.uniform(0.3, 3)), rows=3)
        thr_strict = T.lemma_4_3_threshold(p, q)
        thr_ties = float(np.mean(np.where(p >= q, q, 0).sum(axis=1)))
        assert thr_ties == pytest.approx(thr_strict)  # no ties in continuous random rows
        for lam in (0.5 * thr_strict, thr_strict + 0.5 * (1 - thr_strict)):
            a_star, obj = T.best_a(p, q, lam)
            obj_one = T.rd_objective(p, q, 1.0, lam)
            if T.lemma_4_3_holds(p, q, lam):  # left slope at a = 1 is 2(λ − threshold) > 0
                assert a_star < 1.0 and obj < obj_one
            else:  # the slope is negative just left of 1: vanilla SD (a = 1) is optimal
                assert a_star == 1.0
            # maximising the paper's k = 1 TPS gain (eq. 5) and minimising the objective agree
            gains = _paper_tps_gain(p, q, grid, lam)
            assert _paper_tps_gain(p, q, a_star, lam)[0] >= gains.max() - 1e-12
            assert _paper_tps_gain(p, q, 1.0, lam)[0] == pytest.approx(0.0, abs=1e-14)


def test_lemma_4_3_tie_caveat():
    # p(x1) = q(x1): the paper's Σ_{p>q} q = .2 says RD helps at λ = .3, but the true left slope at
    # a = 1 uses Σ_{p≥q} q = .5, so a = 1 stays optimal until λ > .5 (documented in theory.py).
    p = np.array([0.5, 0.3, 0.2])
    q = np.array([0.2, 0.3, 0.5])
    assert T.lemma_4_3_threshold(p, q) == pytest.approx(0.2)
    assert T.lemma_4_3_holds(p, q, 0.3)
    assert T.best_a(p, q, 0.3)[0] == 1.0
    assert T.best_a(p, q, 0.51)[0] == pytest.approx(0.4)


def _enumerated_rd_rate(a, k_max, alpha, t_q, t_p, t_verify):
    """E[tokens]/E[time] by enumerating the coins b_1..b_kmax and the acceptance outcomes."""
    tokens = time = 0.0
    for coins in itertools.product([0, 1], repeat=k_max):
        prob = math.prod(a if b else 1 - a for b in coins)
        k = next((i for i, b in enumerate(coins) if not b), k_max)  # leading heads
        if k == 0:
            tokens += prob * 1
            time += prob * max(t_p, t_q)
            continue
        for accepted in range(k + 1):
            pr = alpha**accepted * ((1 - alpha) if accepted < k else 1.0)
            tokens += prob * pr * (accepted + 1)
            time += prob * pr * (k * t_q + t_verify(k + 1))
    return tokens / time


def test_rd_tokens_per_second_matches_enumeration_and_limits():
    def t_verify(n):
        return 1.0 + 0.05 * n

    for a, k_max, alpha in [(0.3, 3, 0.6), (0.8, 4, 0.9), (0.55, 1, 0.3), (1.0, 5, 0.7), (0.0, 2, 0.5)]:
        got = T.rd_tokens_per_second(a, k_max, alpha, 0.2, 1.0, t_verify)
        assert got == pytest.approx(_enumerated_rd_rate(a, k_max, alpha, 0.2, 1.0, t_verify), rel=1e-12)
    # a = 1: token verification with k = k_max
    e = T.expected_tokens_per_iteration(0.7, 5)
    expected = e / (5 * 0.2 + t_verify(6))
    assert T.rd_tokens_per_second(1.0, 5, 0.7, 0.2, 1.0, t_verify) == pytest.approx(expected)
    # a = 0: plain target decoding, with the drafter running alongside
    assert T.rd_tokens_per_second(0.0, 5, 0.7, 0.2, 1.0, t_verify) == pytest.approx(1.0)
    assert T.rd_tokens_per_second(0.0, 5, 0.7, 1.5, 1.0, 1.0) == pytest.approx(1 / 1.5)
    # k_max = 1 by hand: [a(1 + α) + (1 − a)] / [a(T_q + T_verify(2)) + (1 − a)·T_p]
    a, alpha = 0.4, 0.8
    hand = (a * (1 + alpha) + (1 - a)) / (a * (0.2 + t_verify(2)) + (1 - a) * 1.0)
    assert T.rd_tokens_per_second(a, 1, lambda _: alpha, 0.2, 1.0, t_verify) == pytest.approx(hand)
    assert T.rd_expected_tokens(0.8, 3) == pytest.approx(1 + 0.8 + 0.64 + 0.512)
    with pytest.raises(ValueError):
        T.rd_tokens_per_second(0.5, 0, 0.5, 0.2, 1.0, 1.0)


def test_best_rd_schedule_beats_every_coarse_candidate_and_picks_sensible_regimes():
    rng = np.random.default_rng(10)
    p, q = _pair(rng, 12, conc=1.0, rows=6)
    q = 0.7 * p + 0.3 * q  # a decent drafter

    def t_verify(n):
        return 1.0 + 0.02 * n

    for t_q in (0.05, 0.4, 0.9):
        sched = T.best_rd_schedule(p, q, t_q, 1.0, t_verify, k_values=range(1, 9), grid=201)
        assert 0 <= sched.a <= 1 and 1 <= sched.k_max <= 8
        assert sched.acceptance == pytest.approx(T.rd_acceptance(p, q, sched.a), abs=1e-12)
        assert sched.tokens_per_second == pytest.approx(
            T.rd_tokens_per_second(sched.a, sched.k_max, sched.acceptance, t_q, 1.0, t_verify))
        for a in np.linspace(0, 1, 11):
            alpha = T.rd_acceptance(p, q, a)
            for k in range(1, 9):
                rate = T.rd_tokens_per_second(a, k, alpha, t_q, 1.0, t_verify)
                assert sched.tokens_per_second >= rate - 1e-12
    # the callable form on the same candidates agrees with the row-based search
    a_grid = np.linspace(0, 1, 11)
    sched = T.best_rd_schedule(p, q, 0.4, 1.0, t_verify, k_values=range(1, 9), grid=11)
    a_grid = np.append(a_grid, T.best_a(p, q, 0.4)[0])
    other = T.best_rd_schedule_for(lambda a: T.rd_acceptance(p, q, a), a_grid, 0.4, 1.0, t_verify,
                                   range(1, 9))
    assert (other.a, other.k_max) == (sched.a, sched.k_max)
    assert other.tokens_per_second == pytest.approx(sched.tokens_per_second, rel=1e-12)
    fast = T.best_rd_schedule(p, q, 0.02, 1.0, t_verify, k_values=range(1, 17))
    assert fast.a == 1.0 and fast.k_max > 3  # a nearly free drafter: always draft, long drafts
    slow = T.best_rd_schedule(p, np.roll(p, 1, axis=1), 0.95, 1.0, t_verify)
    assert slow.a < 0.5  # a slow, poor drafter: mostly run the target alone


# ---------------------------------------------------------------------------------------------
# Tunstall bounds (ERSD Theorem 4.1, Lemma 4.2, D_KL ≤ H[R])
# ---------------------------------------------------------------------------------------------
def test_tunstall_bound_hand_values():
    # (ln 4 + ln 4)/ln 2 = 4; exact leaves: ln(3·3 + 4)/ln 2 = log2(13)
    assert T.tunstall_bound(4, 3, math.log(2)) == pytest.approx(4.0)
    assert T.tunstall_bound(4, 3, math.log(2), exact_leaves=True) == pytest.approx(math.log2(13))
    assert T.tunstall_bound(4, 3, 0.0) == math.inf
    # Lemma 4.2, R = (.5, .25, .25), k = 1: the best tree is one rank-1 node, d = 1, p_res = .5,
    # m >= .5/.5 = 1; m = 1: (ln 2 + ln 2)/(H(.5, .5) + .5·ln 1) = 2 ln 2/ln 2 = 2 >= E = 1.5
    r = [0.5, 0.25, 0.25]
    assert T.optimal_tree_expected_tokens(r, 1) == pytest.approx(1.5)
    assert T.tunstall_bound_refined(r, 1, m=1) == pytest.approx(2.0)
    assert T.tunstall_bound_refined(r, 1) <= 2.0
    with pytest.raises(ValueError, match="m >="):
        T.tunstall_bound_refined([0.5, 0.1, 0.4], 1, d=2, m=1)  # needs m >= .4/.1 = 4


def test_tunstall_bounds_hold_for_optimal_and_arbitrary_trees():
    rng = np.random.default_rng(11)
    for _ in range(60):
        v = int(rng.integers(2, 9))
        r = np.sort(rng.dirichlet(np.full(v, rng.uniform(0.1, 3))))[::-1]
        h = T.rank_entropy(r)
        for k in (0, 1, 3, 8, 30):
            e = T.optimal_tree_expected_tokens(list(r), k)
            exact = T.tunstall_bound(v, k, h, exact_leaves=True)
            assert e <= exact * (1 + 1e-12)
            assert exact <= T.tunstall_bound(v, k, h) * (1 + 1e-12)
            assert e <= T.tunstall_bound_refined(r, k, m_search=5000) * (1 + 1e-9)
        # the source-coding converse does not need optimality: any tree of k nodes obeys it
        parents = [-1]
        for i in range(1, 12):
            parents.append(int(rng.integers(-1, i)))
        e_any = 1 + expected_accepted(parents, list(r))
        assert e_any <= T.tunstall_bound(v, len(parents), h, exact_leaves=True) * (1 + 1e-12)


def _grs_index_distribution(p: np.ndarray, q: np.ndarray, tol: float = 1e-14) -> np.ndarray:
    """Law of the index K of greedy rejection sampling over an i.i.d. list Y_1, Y_2, … ~ Q.

    Harsha et al.: step i outputs y with probability β_i(y) = min(p(y) − A_{i−1}(y), (1 − ΣA_{i−1})·q(y)).
    """
    alloc = np.zeros_like(p)
    law = []
    while 1 - alloc.sum() > tol and len(law) < 100_000:
        beta = np.maximum(np.minimum(p - alloc, (1 - alloc.sum()) * q), 0.0)
        law.append(beta.sum())
        alloc += beta
    return np.array(law)


def test_kl_is_below_entropy_of_the_iid_list_index():
    # Channel-simulation fact behind ERSD eq. 6: H[K] >= D_KL(P‖Q) for the index into an i.i.d.
    # list. The truncated law's entropy is a lower bound of H[K], so the check is conservative.
    rng = np.random.default_rng(12)
    for _ in range(40):
        v = int(rng.integers(2, 7))
        p, q = _pair(rng, v, conc=float(rng.uniform(0.2, 2)))
        q = 0.8 * q + 0.2 / v
        law = _grs_index_distribution(p, q)
        assert T.rank_entropy(law) >= T.kl_divergence(p, q) - 1e-12


def test_kl_can_exceed_entropy_of_ranks_drawn_without_replacement():
    # V = 2, Q = (1 − ε, ε), P = (0, 1): the P-winner is always token 1; its rank in Q's race is 1
    # exactly when token 1 also wins under Q (probability ε). H[R] = h(ε) but D_KL = ln(1/ε).
    eps = 0.01
    p, q = np.array([0.0, 1.0]), np.array([1 - eps, eps])
    rank_law = np.array([eps, 1 - eps])
    assert T.ersd_acceptance(p, q) == pytest.approx(eps)
    assert T.rank_entropy(rank_law) < T.kl_divergence(p, q)


# ---------------------------------------------------------------------------------------------
# speed of light (Pankratov & Alistarh, Theorem 1)
# ---------------------------------------------------------------------------------------------
def test_speed_of_light_hand_computed():
    # μ = 0.5, μ₂ = 0.5: A = (0.5 + 0.5)/0.25 = 4, B = 1 − 1/0.5 = −1, threshold 1 + 0.5/0.25 = 3.
    # Pcap = 63: (63 − (−1))/4 = 16, so E[X] <= 4·ln 16 + 4 − 1 = 11.090354888959125 + 3 = 14.090354888959125
    assert T.speed_of_light_bound(0.5, 0.5, 63) == pytest.approx(14.090354888959125, rel=1e-14)
    # at the threshold the whole tree fits: the bound is A + B = Pcap
    assert T.speed_of_light_bound(0.5, 0.5, 3.0) == pytest.approx(3.0)
    with pytest.raises(ValueError, match=r"1 \+ mu2/mu\^2 = 3"):
        T.speed_of_light_bound(0.5, 0.5, 2.9)
    with pytest.raises(ValueError, match="mu > 0"):
        T.speed_of_light_bound(0.0, 0.5, 100)
    assert T.speed_of_light_asymptotic(0.5, math.e**3) == pytest.approx(6.0)
    assert T.speed_of_light_drafter(2.0, math.e**4) == pytest.approx(2.0)
    assert T.speed_of_light_drafter(2.0, math.e**4, prob_q_zero=0.8) == pytest.approx(1.25)


@pytest.mark.parametrize(("mu", "mu2"), [(0.279, 0.777), (1.088, 6.654), (0.153, 0.29), (2.0, 5.0)])
def test_speed_of_light_equals_the_papers_integral(mu, mu2):
    # Table 1 values of the paper (and one made up): the closed form is ∫ e^{-t} min(P, A e^t + B) dt
    a, b = (mu + mu2) / mu**2, 1 - 1 / mu
    for p_cap in (1 + mu2 / mu**2, 60, 1000):
        kink = math.log((p_cap - b) / a)  # where A e^t + B reaches Pcap
        integral = quad(lambda t, p_cap=p_cap: math.exp(-t) * min(p_cap, a * math.exp(t) + b), 0, 60,
                        points=[kink], limit=200, epsabs=1e-13, epsrel=1e-12)[0]
        assert T.speed_of_light_bound(mu, mu2, p_cap) == pytest.approx(integral, rel=1e-9)


def test_speed_of_light_bounds_the_optimal_tree_of_an_iid_token_tree():
    # Assumption 2 with one fixed next-token law β at every node: the best tree of Pcap nodes
    # (root + Pcap − 1 drafts) accepts 1 + expected_accepted tokens, which Theorem 1 bounds.
    rng = np.random.default_rng(13)
    for _ in range(40):
        v = int(rng.integers(2, 7))
        beta = np.sort(rng.dirichlet(np.full(v, rng.uniform(0.2, 3))))[::-1]
        mu, mu2 = T.entropy_moments(beta[None, :])
        if mu < 1e-3:
            continue
        low = math.ceil(1 + mu2 / mu**2)
        for p_cap in (low, low + 5, 4 * low + 20):
            achieved = 1 + expected_accepted(optimal_tree_shape(list(beta), p_cap - 1), list(beta))
            assert achieved <= T.speed_of_light_bound(mu, mu2, p_cap) + 1e-9

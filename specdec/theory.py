"""Closed-form limits and planning formulas for speculative decoding (docs/algorithms.md §4, §5, §7).

Everything here is a pure function of distributions or of measured rates: the orchestrator uses
it to choose k and a from profiled data, the benchmarks to draw the "speed of light" next to
what was measured, and the tests to check the samplers against the theory.

Conventions
- Distributions are non-negative rows `[..., V]` (numpy arrays, torch tensors of any float
  dtype, or sequences); all arithmetic is float64. Per-row functions return a float for one row
  and an array of shape `[...]` for a batch. Large batches are processed a few rows at a time
  so that e.g. 1000 rows of a 151936-token vocabulary never exist as one float64 copy.
- Logarithms are natural (entropies in nats). The Tunstall bound is a ratio of logarithms, so it
  holds in any base as long as H[R] uses the same base as the numerator: here both are nats.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from specdec.trees import expected_accepted, optimal_tree_shape

ArrayLike = np.ndarray | torch.Tensor | Sequence[float] | Sequence[Sequence[float]]

_CHUNK_ELEMENTS = 1 << 22  # ~32 MiB of float64 per array per chunk


# ----------------------------------------------------------------------------------------------
# input handling
# ----------------------------------------------------------------------------------------------
def _as_array(x: ArrayLike) -> np.ndarray | torch.Tensor:
    """Keep torch tensors as tensors (converted chunk by chunk), everything else → numpy."""
    if isinstance(x, torch.Tensor):
        return x.detach()
    return np.asarray(x)


def _chunk_to_f64(x: np.ndarray | torch.Tensor) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.to("cpu", torch.float64).numpy()
    return np.asarray(x, dtype=np.float64)


def _rows(x: ArrayLike) -> tuple[np.ndarray | torch.Tensor, tuple[int, ...]]:
    """2-D view [N, V] of x plus the leading shape to restore per-row results."""
    arr = _as_array(x)
    if arr.ndim == 0:
        raise ValueError("a distribution needs at least one dimension (the vocabulary)")
    lead = tuple(arr.shape[:-1])
    return arr.reshape(-1, arr.shape[-1]), lead


def _paired_chunks(p: ArrayLike, q: ArrayLike) -> tuple[Iterator[tuple[np.ndarray, np.ndarray]], int, tuple]:
    p2, lead = _rows(p)
    q2, lead_q = _rows(q)
    if tuple(p2.shape) != tuple(q2.shape) or lead != lead_q:
        raise ValueError(f"p and q must have the same shape, got {tuple(_as_array(p).shape)} "
                         f"and {tuple(_as_array(q).shape)}")
    n, v = p2.shape
    step = max(1, _CHUNK_ELEMENTS // max(1, v))

    def gen() -> Iterator[tuple[np.ndarray, np.ndarray]]:
        for start in range(0, n, step):
            yield _chunk_to_f64(p2[start:start + step]), _chunk_to_f64(q2[start:start + step])

    return gen(), n, lead


def _single_chunks(p: ArrayLike) -> tuple[Iterator[np.ndarray], int, tuple]:
    p2, lead = _rows(p)
    n, v = p2.shape
    step = max(1, _CHUNK_ELEMENTS // max(1, v))

    def gen() -> Iterator[np.ndarray]:
        for start in range(0, n, step):
            yield _chunk_to_f64(p2[start:start + step])

    return gen(), n, lead


def _finish(values: list[np.ndarray], lead: tuple) -> float | np.ndarray:
    out = np.concatenate(values) if values else np.zeros(0)
    if not lead:
        return float(out[0])
    return out.reshape(lead)


def _per_row_pq(p: ArrayLike, q: ArrayLike, fn: Callable[[np.ndarray, np.ndarray], np.ndarray]):
    chunks, _, lead = _paired_chunks(p, q)
    return _finish([fn(pc, qc) for pc, qc in chunks], lead)


def _per_row_p(p: ArrayLike, fn: Callable[[np.ndarray], np.ndarray]):
    chunks, _, lead = _single_chunks(p)
    return _finish([fn(pc) for pc in chunks], lead)


# ----------------------------------------------------------------------------------------------
# divergences and entropies
# ----------------------------------------------------------------------------------------------
def total_variation(p: ArrayLike, q: ArrayLike) -> float | np.ndarray:
    """TV(p, q) = ½·Σ|p − q| per row (docs/algorithms.md notation)."""
    return _per_row_pq(p, q, lambda a, b: 0.5 * np.abs(a - b).sum(axis=-1))


def acceptance_rate(p: ArrayLike, q: ArrayLike) -> float | np.ndarray:
    """Token-verification acceptance α = Σ min(p, q) = 1 − TV (Leviathan et al. 2023; §1)."""
    return _per_row_pq(p, q, lambda a, b: np.minimum(a, b).sum(axis=-1))


def _hm(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    s = a + b
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(s > 0, a * b / np.where(s > 0, s, 1.0), 0.0)
    return terms.sum(axis=-1)


def harmonic_mean_divergence(p: ArrayLike, q: ArrayLike) -> float | np.ndarray:
    """D_HM = Σ p·q/(p + q) with 0/0 → 0 (ERSD paper, Lemma 3.1 / eq. 2).

    Lower bound of ERSD's first-token acceptance; D_HM ≤ 1 − TV always (ERSD appendix B).
    """
    return _per_row_pq(p, q, _hm)


def _ersd_match(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    # Pr(winner under p = winner under q = x) = 1 / Σ_y max(p_y/p_x, q_y/q_x). With ρ = p/q the
    # max is p_y/p_x when ρ_y ≥ ρ_x, else q_y/q_x, so sorting by ρ makes the sum two prefix sums.
    out = np.zeros(a.shape[0])
    for row, (pr, qr) in enumerate(zip(a, b, strict=True)):
        with np.errstate(divide="ignore", invalid="ignore"):
            rho = np.where(qr > 0, pr / np.where(qr > 0, qr, 1.0), np.where(pr > 0, np.inf, 0.0))
        order = np.argsort(rho, kind="stable")
        rho_s, p_s, q_s = rho[order], pr[order], qr[order]
        first = np.searchsorted(rho_s, rho_s, side="left")  # entries with ρ < ρ_x come before this
        q_below = np.concatenate([[0.0], np.cumsum(q_s)])[first]
        p_at_or_above = p_s.sum() - np.concatenate([[0.0], np.cumsum(p_s)])[first]
        both = (p_s > 0) & (q_s > 0)
        with np.errstate(divide="ignore", invalid="ignore"):
            denom = p_at_or_above / np.where(both, p_s, 1.0) + q_below / np.where(both, q_s, 1.0)
        out[row] = np.where(both, 1.0 / np.where(both, denom, 1.0), 0.0).sum()
    return out


def ersd_acceptance(p: ArrayLike, q: ArrayLike) -> float | np.ndarray:
    """Exact ERSD first-token acceptance Pr(argmin e/p = argmin e/q), e ~ Exp(1)^V, per row.

    Given e_x = s, x wins both races iff e_y > s·max(p_y/p_x, q_y/q_x) for every y ≠ x, so
    Pr = Σ_x 1 / Σ_y max(p_y/p_x, q_y/q_x) (over x with p_x, q_x > 0); O(V log V) per row.
    Lies in [D_HM, 1 − TV] (ERSD paper, Lemma 3.1).
    """
    return _per_row_pq(p, q, _ersd_match)


def _xlogy(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """x·ln(y) with 0·ln(anything) = 0 and x>0, y=0 → −inf."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(x > 0, x * np.log(np.where(x > 0, y, 1.0)), 0.0)


def kl_divergence(p: ArrayLike, q: ArrayLike) -> float | np.ndarray:
    """D_KL(p‖q) = Σ p·ln(p/q) in nats; +inf where p puts mass on a token q excludes.

    ERSD paper eq. 6 relates it to the entropy of the acceptance distribution (see
    `tunstall_bound` for the caveat on which R that holds for).
    """
    return _per_row_pq(p, q, lambda a, b: (_xlogy(a, a) - _xlogy(a, b)).sum(axis=-1))


def entropy(p: ArrayLike) -> float | np.ndarray:
    """Shannon entropy −Σ p·ln p in nats: the per-row μ of Pankratov & Alistarh (speed of light)."""
    return _per_row_p(p, lambda a: -_xlogy(a, a).sum(axis=-1))


def second_log_moment(p: ArrayLike) -> float | np.ndarray:
    """Σ p·ln²p (≥ 0): the per-row μ₍₂₎ of Pankratov & Alistarh, "second moment of −log".

    Their definition is μ₍₂₎ = E[Σ β·log²β]; squaring removes the sign of log, so this is the
    second moment of the surprisal −ln p under p (not a variance: no mean is subtracted).
    """

    def fn(a: np.ndarray) -> np.ndarray:
        with np.errstate(divide="ignore", invalid="ignore"):
            log = np.log(np.where(a > 0, a, 1.0))
        return np.where(a > 0, a * log * log, 0.0).sum(axis=-1)

    return _per_row_p(p, fn)


def cross_entropy(p: ArrayLike, q: ArrayLike) -> float | np.ndarray:
    """−Σ p·ln q in nats (+inf where p > 0 = q): the drafter-only rate of the speed-of-light paper."""
    return _per_row_pq(p, q, lambda a, b: -_xlogy(a, b).sum(axis=-1))


def entropy_moments(p_rows: ArrayLike) -> tuple[float, float]:
    """(μ, μ₂): mean entropy and mean second log-moment over target rows (speed-of-light inputs)."""
    mu = np.asarray(entropy(p_rows), dtype=np.float64)
    mu2 = np.asarray(second_log_moment(p_rows), dtype=np.float64)
    return float(mu.mean()), float(mu2.mean())


def drafter_cross_entropy(p_rows: ArrayLike, q_rows: ArrayLike) -> tuple[float, float]:
    """(μ_CE, E[Pr(q = 0)]) as defined in Pankratov & Alistarh appendix C (Theorem 5).

    μ_CE = E[−Σ_{q>0} p·ln q / Σ_{q>0} p] is the cross-entropy conditioned on the drafter's
    support; the second value is the mean target mass the drafter can never propose.
    """

    def fn(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        inside = b > 0
        mass = np.where(inside, a, 0.0).sum(axis=-1)
        ce = -np.where(inside, _xlogy(a, b), 0.0).sum(axis=-1)
        with np.errstate(divide="ignore", invalid="ignore"):
            cond = np.where(mass > 0, ce / np.where(mass > 0, mass, 1.0), np.nan)
        return np.stack([cond, a.sum(axis=-1) - mass], axis=-1)

    chunks, _, _ = _paired_chunks(p_rows, q_rows)
    both = np.concatenate([fn(pc, qc) for pc, qc in chunks])
    return float(np.nanmean(both[:, 0])), float(both[:, 1].mean())


# ----------------------------------------------------------------------------------------------
# sequence drafting (speculative-decoding-math.txt; docs/algorithms.md §7)
# ----------------------------------------------------------------------------------------------
def _check_alpha(alpha: float) -> float:
    alpha = float(alpha)
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"acceptance rate alpha must lie in [0, 1], got {alpha}")
    return alpha


def expected_tokens_per_iteration(alpha: float, k: int) -> float:
    """E[tokens/iteration] = (1 − α^{k+1})/(1 − α) = Σ_{i=0..k} α^i; k + 1 at α = 1.

    Sequence drafting with i.i.d. per-token acceptance α (Leviathan et al.; docs/algorithms.md §7).
    Computed as expm1((k+1)·ln α)/expm1(ln α) so it stays accurate as α → 1.
    """
    alpha = _check_alpha(alpha)
    if k < 0 or int(k) != k:
        raise ValueError(f"draft length k must be an integer >= 0, got {k}")
    k = int(k)
    if alpha == 1.0:
        return float(k + 1)
    if alpha == 0.0:
        return 1.0
    log_alpha = math.log1p(alpha - 1.0)
    return math.expm1((k + 1) * log_alpha) / math.expm1(log_alpha)


def speedup(alpha: float, k: int, c: float) -> float:
    """S = E[tokens/iter] / (1 + k/c), c = T_target / T_draft (speculative-decoding-math.txt)."""
    if not c > 0:
        raise ValueError(f"cost ratio c = T_target/T_draft must be > 0, got {c}")
    return expected_tokens_per_iteration(alpha, k) / (1.0 + k / c)


def best_k(alpha: float, c: float, k_max: int = 20, k_min: int = 1) -> tuple[int, float]:
    """(k*, S(k*)) maximising `speedup` over k_min..k_max (ties → smallest k).

    Defaults match the table in speculative-decoding-math.txt (k from 1 to 20); pass k_min=0
    to let "do not speculate" (S = 1) compete.
    """
    if k_min < 0 or k_max < k_min:
        raise ValueError(f"need 0 <= k_min <= k_max, got k_min={k_min}, k_max={k_max}")
    best = (k_min, speedup(alpha, k_min, c))
    for k in range(k_min + 1, k_max + 1):
        s = speedup(alpha, k, c)
        if s > best[1]:
            best = (k, s)
    return best


# ----------------------------------------------------------------------------------------------
# randomised drafting (Toner et al., ICML 2025; docs/algorithms.md §5)
# ----------------------------------------------------------------------------------------------
def _check_a(a: float) -> float:
    a = float(a)
    if not 0.0 <= a <= 1.0:
        raise ValueError(f"draft probability a must lie in [0, 1], got {a}")
    return a


def rd_acceptance_curve(p_rows: ArrayLike, q_rows: ArrayLike, a_values: Iterable[float]) -> np.ndarray:
    """α(a) averaged over rows, exactly, for every a in `a_values` (one pass over the data).

    Uses α(a) = Σ_x q·min(1, p/(a·q)) = Σ_x min(q, p/a), the first line of the proof of Toner et
    al. Lemma A.3; for normalised rows it equals their (1 + a − |p − aQ|₁)/(2a). At a = 0 it is
    the limit a → 0⁺, Σ_{x: p>0} q(x) (every drafted token the target allows is accepted).
    """
    a_arr = np.asarray(list(a_values), dtype=np.float64)
    if a_arr.size and (np.any(a_arr < 0) or np.any(a_arr > 1) or np.any(np.isnan(a_arr))):
        raise ValueError(f"draft probabilities a must lie in [0, 1], got {a_arr}")
    grid, inverse = np.unique(a_arr, return_inverse=True)
    g = grid.size
    sum_p_lt = np.zeros(g + 1)  # Σ p over entries with exactly i grid points <= r, then cumsum
    sum_q_at = np.zeros(g + 1)
    q_positive_ratio = 0.0      # Σ q over entries with r > 0 (the a = 0 limit)
    q_total = 0.0
    chunks, n, _ = _paired_chunks(p_rows, q_rows)
    for pc, qc in chunks:
        mask = qc > 0
        pm, qm = pc[mask], qc[mask]
        r = pm / qm
        idx = np.searchsorted(grid, r, side="right")  # number of grid points <= r
        sum_p_lt += np.bincount(idx, weights=pm, minlength=g + 1)
        sum_q_at += np.bincount(idx, weights=qm, minlength=g + 1)
        q_positive_ratio += float(qm[pm > 0].sum())
        q_total += float(qm.sum())
    if n == 0:
        raise ValueError("no rows given")
    # entry with idx = i satisfies r >= grid[j] for j < i and r < grid[j] for j >= i
    p_below = np.cumsum(sum_p_lt)[:g]                  # Σ p over r < grid[j]
    q_at_or_above = q_total - np.cumsum(sum_q_at)[:g]  # Σ q over r >= grid[j]
    with np.errstate(divide="ignore", invalid="ignore"):
        alpha = np.where(grid > 0, q_at_or_above + p_below / np.where(grid > 0, grid, 1.0), q_positive_ratio)
    return alpha[inverse] / n


def rd_acceptance(p: ArrayLike, q: ArrayLike, a: float) -> float:
    """Per-drafted-token acceptance α(a) = (1 + a − |P − aQ|₁)/(2a), averaged over rows.

    Toner et al. Lemma 4.1 (eq. 4). Decreasing in a; at a = 1 it is 1 − TV; the a → 0 limit is
    handled exactly (see `rd_acceptance_curve`).
    """
    return float(rd_acceptance_curve(p, q, [_check_a(a)])[0])


def rd_objective(p_rows: ArrayLike, q_rows: ArrayLike, a: float, lam: float) -> float:
    """mean_z |P_z − a·Q_z|₁ + a·(2λ − 1): the quantity RD's best a minimises (Toner et al. §4.3)."""
    a = _check_a(a)
    chunks, n, _ = _paired_chunks(p_rows, q_rows)
    total = sum(float(np.abs(pc - a * qc).sum()) for pc, qc in chunks)
    return total / n + a * (2.0 * float(lam) - 1.0)


def lemma_4_3_threshold(p_rows: ArrayLike, q_rows: ArrayLike) -> float:
    """mean_z Σ_{x: p_z(x) > q_z(x)} q_z(x): the right-hand side of Toner et al. Lemma 4.3.

    The paper states the lemma per prompt (one row). For a workload the same derivative argument
    applied to the averaged objective (their §4.3, rows concatenated) gives the row average, which
    is what this returns; for a single row the two coincide.
    """

    def fn(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return np.where(a > b, b, 0.0).sum(axis=-1)

    values = np.atleast_1d(np.asarray(_per_row_pq(p_rows, q_rows, fn), dtype=np.float64))
    return float(values.mean())


def lemma_4_3_holds(p_rows: ArrayLike, q_rows: ArrayLike, lam: float) -> bool:
    """Toner et al. Lemma 4.3: RD can beat vanilla SD when λ = T_q/T_p ≥ Σ_{x: p>q} q(x).

    Averaged over rows (see `lemma_4_3_threshold`). Precisely, the objective's left slope at a = 1
    is 2·(λ − mean Σ_{x: p ≥ q} q), so RD is *strictly* better than a = 1 iff λ exceeds the
    threshold with p ≥ q in place of p > q; the two differ only when some p(x) = q(x) > 0, and at
    equality the best a ties with a = 1.
    """
    return float(lam) >= lemma_4_3_threshold(p_rows, q_rows)


def _ratio_weights(p_rows: ArrayLike, q_rows: ArrayLike, lo: float, hi: float
                   ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(ratio p/q, q/N) for entries with q > 0 and lo <= p/q < hi, chunk by chunk."""
    chunks, n, _ = _paired_chunks(p_rows, q_rows)
    for pc, qc in chunks:
        mask = qc > 0
        r = pc[mask] / qc[mask]
        w = qc[mask] / n
        keep = (r >= lo) & (r < hi)
        yield r[keep], w[keep]


def _upper_weighted_quantile(p_rows: ArrayLike, q_rows: ArrayLike, tau: float,
                             collect_cap: int = 1 << 21, bins: int = 4096) -> float:
    """Smallest ratio v in [0, 1) with Σ_{r <= v} w > tau (caller guarantees one exists).

    Exact, with bounded memory: narrow [lo, hi) by weighted histograms until few enough entries
    remain, then sort those (compressed to distinct values) and scan the cumulative weight.
    """
    lo, hi, below = 0.0, 1.0, 0.0
    previous_count = -1
    while True:
        count = sum(int(r.size) for r, _ in _ratio_weights(p_rows, q_rows, lo, hi))
        if count <= collect_cap or count == previous_count:
            values, weights = [], []
            for r, w in _ratio_weights(p_rows, q_rows, lo, hi):
                if r.size:
                    u, inv = np.unique(r, return_inverse=True)
                    values.append(u)
                    weights.append(np.bincount(inv, weights=w, minlength=u.size))
            if not values:
                return lo
            u, inv = np.unique(np.concatenate(values), return_inverse=True)
            w = np.bincount(inv, weights=np.concatenate(weights), minlength=u.size)
            cum = below + np.cumsum(w)
            hit = int(np.searchsorted(cum, tau, side="right"))  # first cum > tau
            return float(u[min(hit, u.size - 1)])
        previous_count = count
        edges = np.linspace(lo, hi, bins + 1)
        hist = np.zeros(bins + 1)
        for r, w in _ratio_weights(p_rows, q_rows, lo, hi):
            hist += np.bincount(np.searchsorted(edges, r, side="right") - 1, weights=w, minlength=bins + 1)
        cum = below + np.cumsum(hist[:bins])
        b = min(int(np.searchsorted(cum, tau, side="right")), bins - 1)
        below = below + (float(cum[b - 1] - below) if b > 0 else 0.0)
        lo, hi = float(edges[b]), float(edges[b + 1])


def best_a(p_rows: ArrayLike, q_rows: ArrayLike, lam: float) -> tuple[float, float]:
    """(a*, objective) minimising mean_z |P_z − a·Q_z|₁ + a·(2λ − 1) over a ∈ [0, 1], exactly.

    Toner et al. Lemma 4.4 / §4.3 (workload form). The objective is convex and piecewise linear
    with breakpoints at the ratios p(x)/q(x); its slope just left of a is 2·G(a) − τ₂ with
    G(a) = mean_z Σ_{x: p/q < a} q and τ₂ = mean_z Σ q + 1 − 2λ. So the minimiser is a weighted
    quantile of the ratios (weights q), found without sorting the whole vocabulary (see
    `_upper_weighted_quantile`). When the minimum is flat the LARGEST minimiser is returned, so
    a* < 1 exactly when randomised drafting is strictly better than vanilla SD.
    """
    lam = float(lam)
    if not lam >= 0:
        raise ValueError(f"lambda = T_q/T_p must be >= 0, got {lam}")
    chunks, n, _ = _paired_chunks(p_rows, q_rows)
    q_mass = 0.0
    weight_below_one = 0.0
    for pc, qc in chunks:
        mask = qc > 0
        q_mass += float(qc[mask].sum())
        weight_below_one += float(qc[mask][pc[mask] < qc[mask]].sum())
    if n == 0:
        raise ValueError("no rows given")
    tau = 0.5 * (q_mass / n + 1.0 - 2.0 * lam)
    if tau < 0:
        a_star = 0.0  # slope positive everywhere: drafting never pays
    elif weight_below_one / n <= tau:
        a_star = 1.0
    else:
        a_star = _upper_weighted_quantile(p_rows, q_rows, tau)
    return a_star, rd_objective(p_rows, q_rows, a_star, lam)


def rd_expected_tokens(alpha_a: float, j: int) -> float:
    """Tokens emitted by an RD iteration that drafted K = j tokens: (1 − α^{j+1})/(1 − α).

    docs/algorithms.md §5 extension of Toner et al.: j drafted tokens, each accepted w.p. α(a), plus one
    token at the end (a residual of the RD rule if j < k_max, a sample of P_{j+1} if j = k_max —
    either way exactly one).
    """
    return expected_tokens_per_iteration(alpha_a, j)


def _verify_times(t_verify: Callable[[int], float] | float, k_max: int) -> np.ndarray:
    """[T_verify(2), …, T_verify(k_max + 1)]: a target pass scoring j + 1 positions, j = 1..k_max."""
    if callable(t_verify):
        return np.array([float(t_verify(j + 1)) for j in range(1, k_max + 1)])
    return np.full(k_max, float(t_verify))


def _rd_tps(a: np.ndarray, alpha: np.ndarray, k_max: int, t_q: float, t_p: float,
            tv: np.ndarray) -> np.ndarray:
    """Vectorised renewal-reward tokens/s over arrays of (a, α(a))."""
    a = np.asarray(a, dtype=np.float64)
    alpha = np.asarray(alpha, dtype=np.float64)
    tokens = (1.0 - a) * 1.0
    time = (1.0 - a) * max(t_p, t_q)
    power = np.ones_like(alpha)  # α^j
    cumulative = np.ones_like(alpha)  # Σ_{i<=j} α^i
    for j in range(1, k_max + 1):
        power = power * alpha
        cumulative = cumulative + power
        prob = a**j * ((1.0 - a) if j < k_max else 1.0)
        tokens = tokens + prob * cumulative
        time = time + prob * (j * t_q + tv[j - 1])
    return tokens / time


def rd_tokens_per_second(a: float, k_max: int, alpha_of_a: Callable[[float], float] | float,
                         t_q: float, t_p: float, t_verify: Callable[[int], float] | float) -> float:
    """Long-run tokens/s of RD with draft probability a and cap k_max (docs/algorithms.md §5; renewal-reward).

    K ~ truncated geometric: P(K = j) = a^j·(1 − a) for j < k_max, a^{k_max} for j = k_max.
    K = 0 emits 1 token in max(T_p, T_q) (drafter and target run concurrently); K = j ≥ 1 emits
    (1 − α^{j+1})/(1 − α) tokens in j·T_q + T_verify(j + 1), as §5 states (the drafter's extra pass
    for Q_{j+1} when j < k_max is taken to hide under the verifier's pass). Tokens/s =
    E[tokens]/E[time]. `alpha_of_a` is α(a) as a callable or already evaluated at this a;
    `t_verify(n)` is the time of a target pass scoring n positions (or a constant).
    a = 1 is ordinary token verification with k = k_max; a = 0 is plain target decoding.
    """
    a = _check_a(a)
    if int(k_max) != k_max or k_max < 1:
        raise ValueError(f"k_max must be an integer >= 1, got {k_max}")
    if not (t_q >= 0 and t_p > 0):
        raise ValueError(f"need t_q >= 0 and t_p > 0, got t_q={t_q}, t_p={t_p}")
    alpha = _check_alpha(alpha_of_a(a) if callable(alpha_of_a) else alpha_of_a)
    tv = _verify_times(t_verify, int(k_max))
    return float(_rd_tps(np.array([a]), np.array([alpha]), int(k_max), float(t_q), float(t_p), tv)[0])


@dataclass(frozen=True)
class RDSchedule:
    """The best (a, k_max) found by `best_rd_schedule` and what it predicts."""

    a: float
    k_max: int
    tokens_per_second: float
    acceptance: float


def best_rd_schedule_for(alpha_of_a: Callable[[float], float], a_candidates: Iterable[float],
                         t_q: float, t_p: float, t_verify: Callable[[int], float] | float,
                         k_values: Iterable[int] = range(1, 17)) -> RDSchedule:
    """Maximise `rd_tokens_per_second` over a ∈ a_candidates × k_max ∈ k_values (grid search).

    Ties keep the first found (smallest k_max, then smallest a).
    """
    a_arr = np.unique(np.clip(np.asarray(list(a_candidates), dtype=np.float64), 0.0, 1.0))
    alpha = np.array([_check_alpha(alpha_of_a(float(a))) for a in a_arr])
    return _best_schedule(a_arr, alpha, t_q, t_p, t_verify, k_values)


def _best_schedule(a_arr: np.ndarray, alpha: np.ndarray, t_q: float, t_p: float,
                   t_verify: Callable[[int], float] | float, k_values: Iterable[int]) -> RDSchedule:
    ks = sorted({int(k) for k in k_values})
    if not ks or ks[0] < 1:
        raise ValueError(f"k_values must be integers >= 1, got {ks}")
    if not (t_q >= 0 and t_p > 0):
        raise ValueError(f"need t_q >= 0 and t_p > 0, got t_q={t_q}, t_p={t_p}")
    tv_all = _verify_times(t_verify, ks[-1])
    best: RDSchedule | None = None
    for k in ks:
        tps = _rd_tps(a_arr, alpha, k, float(t_q), float(t_p), tv_all[:k])
        i = int(np.argmax(tps))
        if best is None or tps[i] > best.tokens_per_second:
            best = RDSchedule(float(a_arr[i]), k, float(tps[i]), float(alpha[i]))
    assert best is not None
    return best


def best_rd_schedule(p_rows: ArrayLike, q_rows: ArrayLike, t_q: float, t_p: float,
                     t_verify: Callable[[int], float] | float, *, k_values: Iterable[int] = range(1, 17),
                     grid: int = 1001) -> RDSchedule:
    """Best (a, k_max) for a profiled workload (rows of P and Q), docs/algorithms.md §5.

    Candidates: `grid` evenly spaced a in [0, 1] plus the exact k = 1 optimum of Toner et al.
    (`best_a` with λ = t_q/t_p); α(a) is evaluated exactly at every candidate in one pass.
    The grid resolution bounds how far the returned a can sit from the true optimum.
    """
    if grid < 2:
        raise ValueError(f"grid must be >= 2, got {grid}")
    a_star, _ = best_a(p_rows, q_rows, float(t_q) / float(t_p))
    a_arr = np.unique(np.concatenate([np.linspace(0.0, 1.0, grid), [a_star]]))
    alpha = np.clip(rd_acceptance_curve(p_rows, q_rows, a_arr), 0.0, 1.0)
    return _best_schedule(a_arr, alpha, t_q, t_p, t_verify, k_values)


# ----------------------------------------------------------------------------------------------
# Tunstall bounds (Kobus & Gündüz, ERSD paper: Theorem 4.1, Lemma 4.2, appendix C)
# ----------------------------------------------------------------------------------------------
def rank_entropy(rank_acceptance: Sequence[float] | np.ndarray) -> float:
    """H[R] in nats of a 0th-order acceptance distribution over child ranks (any missing mass is
    NOT added as an extra symbol; pass a complete distribution)."""
    r = np.asarray(rank_acceptance, dtype=np.float64)
    return float(-_xlogy(r, r).sum())


def tunstall_bound(vocab: int, k: int, h_r: float, *, exact_leaves: bool = False) -> float:
    """ERSD Theorem 4.1: E[tokens/iteration] ≤ (ln|V| + ln(k + 1)) / H[R] (H[R] in nats).

    With `exact_leaves`, the tighter intermediate form of appendix C, ln(k(|V| − 1) + |V|)/H[R]
    (the number of leaves of the Tunstall tree). Valid for the optimal tree under a 0th-order
    acceptance model R (in fact for any tree of k draft nodes: it is the source-coding converse).
    H[R] = 0 gives +inf.

    Note on D_KL(P‖Q) ≤ H[R] (their eq. 6, from channel simulation): it holds when R is the law
    of the index of the accepted proposal in a list of i.i.d. draws from Q (the proof uses
    Pr(K = k, Y_k = y) ≤ Q(y)). For ranks of children drawn WITHOUT replacement, as in draft
    trees, it can fail: V = 2, Q = (1 − ε, ε), P = (0, 1) gives H[R] = h(ε) ≤ ln 2 while
    D_KL = ln(1/ε). The tests check both statements.
    """
    if vocab < 1 or k < 0:
        raise ValueError(f"need vocab >= 1 and k >= 0, got vocab={vocab}, k={k}")
    if not h_r >= 0:
        raise ValueError(f"H[R] must be >= 0, got {h_r}")
    numerator = math.log(k * (vocab - 1) + vocab) if exact_leaves else math.log(vocab) + math.log(k + 1)
    if h_r == 0:
        return math.inf if numerator > 0 else math.nan
    return numerator / h_r


def optimal_tree_expected_tokens(rank_acceptance: Sequence[float], budget: int) -> float:
    """1 + expected accepted nodes of the best `budget`-node tree (docs/algorithms.md §6; ERSD Alg. 3)."""
    parents = optimal_tree_shape(rank_acceptance, budget)
    return 1.0 + expected_accepted(parents, rank_acceptance)


def _max_rank_used(rank_acceptance: Sequence[float], k: int) -> int:
    parents = optimal_tree_shape(rank_acceptance, k)
    value: list[float] = []
    seen: dict[int, int] = {}
    d = 1
    for parent in parents:
        rank = seen.get(parent, 0)
        seen[parent] = rank + 1
        value.append((1.0 if parent < 0 else value[parent]) * float(rank_acceptance[rank]))
        if value[-1] > 0:
            d = max(d, rank + 1)
    return d


def tunstall_bound_refined(rank_acceptance: Sequence[float] | np.ndarray, k: int,
                           d: int | None = None, m: int | None = None, *, m_search: int = 1_000_000) -> float:
    """ERSD Lemma 4.2: E[tokens] ≤ (ln(d + m) + ln(k + 1)) / (H[R^res] + p_res·ln m).

    R = `rank_acceptance` (R[0] is rank 1) is a 0th-order acceptance distribution over ranks;
    d is the largest rank the optimal k-node tree uses (computed with `optimal_tree_shape` when
    None, ignoring zero-value nodes); p_res = 1 − Σ_{i≤d} R(i); R^res = (R(1..d), p_res). The
    lemma needs an integer m ≥ p_res / min_{i≤d} R(i). With m None, the bound is minimised over
    m in [m_min, m_min + m_search] (the paper's "minimal upper bound"). Like
    `optimal_tree_shape`, this expects R non-increasing in rank.
    """
    r = np.asarray(rank_acceptance, dtype=np.float64)
    if r.ndim != 1 or r.size == 0 or np.any(r < 0) or np.any(r > 1) or r.sum() > 1 + 1e-9:
        raise ValueError("rank_acceptance must be a 1-D sub-probability vector over ranks")
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    if d is None:
        d = _max_rank_used(list(r), k)
    if not 1 <= d <= r.size:
        raise ValueError(f"d must lie in [1, {r.size}], got {d}")
    head = r[:d]
    if np.any(head <= 0):
        raise ValueError("every rank up to d needs R(i) > 0 for Lemma 4.2")
    p_res = max(0.0, 1.0 - float(head.sum()))
    h_res = float(-_xlogy(head, head).sum() - (p_res * math.log(p_res) if p_res > 0 else 0.0))
    m_min = math.ceil(p_res / float(head.min()) - 1e-12) if p_res > 0 else 0
    m_min = max(m_min, 1) if p_res > 0 else m_min

    def bound(ms: np.ndarray) -> np.ndarray:
        with np.errstate(divide="ignore", invalid="ignore"):
            log_m = np.where(ms > 0, np.log(np.maximum(ms, 1)), 0.0)
            return (np.log(d + ms) + math.log(k + 1)) / (h_res + p_res * log_m)

    if m is not None:
        if int(m) != m or m < m_min:
            need = p_res / float(head.min())
            raise ValueError(f"Lemma 4.2 needs an integer m >= p_res/min R = {need:.6g}, got m={m}")
        return float(bound(np.array([float(m)]))[0])
    ms = np.arange(m_min, m_min + m_search + 1, dtype=np.float64)
    return float(np.min(bound(ms)))


# ----------------------------------------------------------------------------------------------
# speed of light (Pankratov & Alistarh, Theorems 1, 2 and 5)
# ----------------------------------------------------------------------------------------------
def speed_of_light_bound(mu: float, mu2: float, p_cap: float) -> float:
    """Theorem 1: E[X] ≤ A·ln((Pcap − B)/A) + A + B, A = (μ + μ₂)/μ², B = 1 − 1/μ.

    μ = mean target entropy (nats), μ₂ = mean Σ p·ln²p, Pcap = verifier capacity (tokens scored
    per pass). Any deterministic drafting; valid only for Pcap ≥ 1 + μ₂/μ² (= A + B, where the
    bound equals Pcap itself). X is the paper's Σ_{v ∈ Tree*} P(v) over the Pcap best nodes with
    the root counted, i.e. 1 + expected accepted drafts of a tree of Pcap − 1 draft nodes.
    """
    mu, mu2, p_cap = float(mu), float(mu2), float(p_cap)
    if not (math.isfinite(mu) and mu > 0):
        raise ValueError(f"speed_of_light_bound needs a finite mean entropy mu > 0, got {mu}")
    if not (math.isfinite(mu2) and mu2 >= 0):
        raise ValueError(f"speed_of_light_bound needs a finite second log-moment mu2 >= 0, got {mu2}")
    threshold = 1.0 + mu2 / (mu * mu)
    if not (math.isfinite(p_cap) and p_cap >= threshold):
        raise ValueError(f"speed_of_light_bound (Pankratov & Alistarh Thm 1) needs p_cap >= 1 + mu2/mu^2 "
                         f"= {threshold:.6g}; got p_cap = {p_cap}")
    big_a = (mu + mu2) / (mu * mu)
    big_b = 1.0 - 1.0 / mu
    return big_a * math.log((p_cap - big_b) / big_a) + big_a + big_b


def speed_of_light_asymptotic(mu: float, p_cap: float) -> float:
    """Theorem 2: E[X] ≈ ln(Pcap)/μ for an optimal deterministic drafter (o(ln Pcap) dropped)."""
    if not mu > 0 or not p_cap >= 1:
        raise ValueError(f"need mu > 0 and p_cap >= 1, got mu={mu}, p_cap={p_cap}")
    return math.log(p_cap) / mu


def speed_of_light_drafter(mu_ce: float, p_cap: float, prob_q_zero: float = 0.0) -> float:
    """Theorem 5: with only the drafter's q, E[X] ≳ min(1/E[Pr(q = 0)], ln(Pcap)/μ_CE).

    An estimate (o(ln Pcap) dropped) of what drafting from q alone achieves; see
    `drafter_cross_entropy` for μ_CE and E[Pr(q = 0)].
    """
    if not mu_ce > 0 or not p_cap >= 1 or not 0 <= prob_q_zero <= 1:
        raise ValueError(f"need mu_ce > 0, p_cap >= 1, prob_q_zero in [0, 1]; "
                         f"got {mu_ce}, {p_cap}, {prob_q_zero}")
    rate = math.log(p_cap) / mu_ce
    return min(rate, 1.0 / prob_q_zero) if prob_q_zero > 0 else rate

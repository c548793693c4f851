"""Position-keyed exponential races (ERSD).

A race at absolute position n is a vector e_n of i.i.d. Exp(1) variables, one per token. The
winner under a distribution D is argmin_x e_n(x) / D(x); it is distributed exactly as D, and the
first m arrivals (m smallest ratios) are a sample of m distinct tokens without replacement.

Construction (reproducible across processes and machines, no state to ship):
  key     = derive_seed(seed, "race")                  (64-bit, see specdec.randomness)
  counter = Philox4x64-10 counter [0, 0, n, 0]         (n = absolute position in the sequence)
  raw_j   = j-th 64-bit output of that counter-based stream, j = 0..V-1
  u_j     = ((raw_j >> 11) + 0.5) / 2**53              (uniform on (0, 1), never 0 or 1)
  e_n(j)  = -ln(u_j)
The position sits in the third counter word, so streams of different positions never overlap
(each holds 2**128 blocks). Drafter and verifier regenerate e_n from (seed, n) alone, which is
why ERSD sends only token ids over the network.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from specdec.randomness import derive_seed


def _raw(seed: int, position: int, vocab: int) -> np.ndarray:
    """raw >> 11 for j = 0..vocab-1 (uint64, each below 2**53): the race's integers before the log."""
    if position < 0:
        raise ValueError(f"race position must be >= 0, got {position}")
    bit_generator = np.random.Philox(key=derive_seed(seed, "race"), counter=[0, 0, position, 0])
    raw = bit_generator.random_raw(vocab)
    raw >>= np.uint64(11)
    return raw


def _exponentials(shifted: np.ndarray) -> np.ndarray:
    """e = -ln(((raw >> 11) + 0.5) / 2**53), in place on the float64 buffer it makes. After the shift
    every value is below 2**53, so the signed conversion is exact."""
    values = shifted.view(np.int64).astype(np.float64)
    values += 0.5
    values *= 1.0 / 9007199254740992.0
    np.log(values, out=values)
    np.negative(values, out=values)
    return values


def race(seed: int, position: int, vocab: int) -> torch.Tensor:
    """The Exp(1) race vector e_position of length `vocab` (float64). The formula above, in place on
    one buffer (a fresh 1.2 MB array per step cost more than the arithmetic)."""
    return torch.from_numpy(_exponentials(_raw(seed, position, vocab)))


# race_winner_at: tokens above this probability are scored exactly; below it a token can win only if
# its uniform lies within about HEAVY·B of 1 (B: the best heavy score), which an integer bound finds.
HEAVY = 1e-4
_SLACK = 64  # integer steps of 2**-53 kept below the bound (the pruned path runs only at HEAVY·B < 0.3)
_CANDIDATE_SHARE = 0.25  # more candidates than this share of the vocabulary: score them all


def race_winner_at(seed: int, position: int, dist: torch.Tensor) -> int | None:
    """argmin_x e_position(x) / D(x), the winner of the race under D (None: D has no positive mass),
    bitwise the token that race_scores and argmin pick, without scoring every token.

    Why it is exact. Scores are e / max(D, tiny) with e = -ln(u) as in `race`. Let B be the best
    score among the heavy tokens (D > HEAVY). A light token (D ≤ HEAVY) scores at least e / HEAVY,
    so it can tie or beat B only if e ≤ HEAVY·B, that is u ≥ exp(-HEAVY·B). Its integer k = raw >> 11
    (u = (k + 0.5) / 2**53) is then at least floor(exp(-HEAVY·B)·2**53) - 1; every light token from
    _SLACK below that bound up is a candidate and is scored exactly like the heavy ones, with the
    same numpy arithmetic as `race`. Every other token's score is above B, so none of them is the
    first minimum. On the default target's rows at T = 1 (152k tokens, 1 thread) a winner took
    1.60 ms with every token scored and takes 0.84 ms so (bench/results/xeon-2026-12-03-b/
    race-winner.txt); drawing the integers is most of what is left.
    """
    probs = dist.detach().to("cpu", torch.float64).numpy()
    vocab = probs.shape[-1]
    shifted = _raw(seed, position, vocab)
    candidates = None  # every token with D > 0, unless the heavy ones bound the rest
    heavy = np.flatnonzero(probs > HEAVY)
    if heavy.size:
        best_heavy = float(np.min(_exponentials(shifted[heavy]) / probs[heavy]))
        bound = int(math.floor(math.exp(-HEAVY * best_heavy) * 9007199254740992.0)) - 1 - _SLACK
        pruned = np.union1d(heavy, np.flatnonzero(shifted >= np.uint64(max(bound, 0))))
        if pruned.size <= _CANDIDATE_SHARE * vocab:
            candidates = pruned[probs[pruned] > 0]
    if candidates is None:
        candidates = np.flatnonzero(probs > 0)
    if not candidates.size:
        return None
    # race_scores' arithmetic, e / max(D, tiny); argmin takes the first (lowest id) minimum.
    scores = _exponentials(shifted[candidates]) / np.maximum(probs[candidates], np.finfo(np.float64).tiny)
    return int(candidates[np.argmin(scores)])


# Below this a lone positive mass could make e / D overflow to inf (e <= 37.5), which the full race
# reports as "no positive mass"; above it the shortcut and the race agree.
_SURE_MASS = 1e-300


def sole_support(dist: torch.Tensor) -> int | None:
    """The token of a distribution with exactly one positive entry (a greedy row), else None.

    Such a row's race has one finite arrival, so its winner is that token whatever the race: a
    target-only step at temperature 0 skips drawing V exponentials (~2 ms at V = 152k).
    """
    positive = dist > 0
    if int(positive.sum()) != 1:
        return None
    token = int(torch.argmax(positive.to(torch.uint8)))
    return token if float(dist[token]) >= _SURE_MASS else None


def race_scores(e: torch.Tensor, dist: torch.Tensor) -> torch.Tensor:
    """Arrival times e / D, with +inf where D = 0 (such tokens never win).

    Computed where the race lives (the CPU, float64) whatever device D's row comes from, so that
    the drafter and the verifier rank arrivals with the same arithmetic on any device.
    """
    dist = dist.to(device=e.device, dtype=torch.float64)
    return torch.where(dist > 0, e / dist.clamp_min(torch.finfo(torch.float64).tiny), torch.inf)


def race_winner(e: torch.Tensor, dist: torch.Tensor) -> int:
    """argmin_x e(x)/D(x): a sample from D driven by the race e."""
    return int(torch.argmin(race_scores(e, dist)).item())


def race_arrivals(e: torch.Tensor, dist: torch.Tensor, m: int) -> list[int]:
    """The first m arrivals of the race under D (never a zero-probability token)."""
    scores = race_scores(e, dist)
    m = min(m, int((scores < torch.inf).sum().item()))
    if m <= 0:
        return []
    order = torch.topk(scores, m, largest=False, sorted=True).indices
    return [int(i) for i in order.tolist()]

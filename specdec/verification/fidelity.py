"""The statistical half of fidelity testing (docs/algorithms.md §10): do sampled outputs follow an
exactly enumerated law? One pooled chi-square, shared by the test suite and the device check."""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Mapping, Sequence


def chi_square_p(samples: Sequence[Hashable], exact: Mapping[Hashable, float]) -> float:
    """Chi-square p-value of `samples` against the law `exact` (outcome → probability).

    Cells expected to hold fewer than 5 samples are pooled into one, and so are samples outside
    `exact`'s support: a law that puts no mass where samples fell gets p = 0. Expectations are
    rescaled to the sample count (the enumeration's float rounding)."""
    from scipy.stats import chisquare

    n = len(samples)
    counts = Counter(samples)
    observed, expected, rest_observed, rest_expected = [], [], 0, 0.0
    for key, p in exact.items():
        if n * p >= 5:
            observed.append(counts.get(key, 0))
            expected.append(n * p)
        else:
            rest_observed += counts.get(key, 0)
            rest_expected += n * p
    rest_observed += sum(count for key, count in counts.items() if key not in exact)
    if rest_expected > 0:
        observed.append(rest_observed)
        expected.append(rest_expected)
    elif rest_observed:
        return 0.0  # samples where the law has no mass
    if len(observed) < 2:
        return 1.0
    scale = sum(observed) / sum(expected)
    return float(chisquare(observed, [e * scale for e in expected]).pvalue)

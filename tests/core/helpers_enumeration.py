"""Exact distributions of randomised code, by enumerating every outcome of its random draws.

`enumerate_outcomes(fn)` runs `fn(source)` again and again with a `RandomSource` whose answers
are forced by a list of choice indices. A draw beyond the forced prefix takes its first branch
and records how many branches it had; afterwards the search moves to the next unexplored
branch (depth-first, by replaying the whole function with the new prefix). Every branch carries
its exact probability (p and 1 − p for a Bernoulli, P(x) for every token with P(x) > 0 for a
categorical; zero-probability branches are skipped), so the result is the exact distribution
of fn's return value — as exact as float64 products and sums allow.

`fn` must be deterministic given the answers of its draws (the code under test is: its only
randomness comes from the source).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Hashable
from typing import TypeVar

import torch

Outcome = TypeVar("Outcome", bound=Hashable)

# A categorical distribution handed to the source must sum to 1 up to rounding.
_SUM_TOLERANCE = 1e-9


class EnumerationError(RuntimeError):
    """The function did something the enumeration cannot follow (bad probabilities, too many runs)."""


class ReplaySource:
    """A RandomSource whose draws follow `forced` choice indices, then take branch 0."""

    def __init__(self, forced: list[int]) -> None:
        self.forced = forced
        self.choices: list[int] = []
        self.widths: list[int] = []
        self.probability = 1.0

    def _choose(self, branches: list[tuple[object, float]]) -> object:
        step = len(self.choices)
        index = self.forced[step] if step < len(self.forced) else 0
        if index >= len(branches):
            raise EnumerationError("the function is not deterministic given its draws (branch count changed)")
        self.choices.append(index)
        self.widths.append(len(branches))
        value, probability = branches[index]
        self.probability *= probability
        return value

    def checkpoint(self) -> tuple[int, float]:
        """Where the draws stand now, for `rewind`."""
        return len(self.choices), self.probability

    def rewind(self, checkpoint: tuple[int, float]) -> None:
        """Forget the draws since `checkpoint`: the next ones repeat them (forced, or branch 0 as
        before) — what a seeded source re-created from the same key does (docs/algorithms.md §12)."""
        step, self.probability = checkpoint
        del self.choices[step:], self.widths[step:]

    def bernoulli(self, p: float) -> bool:
        p = float(p)
        if p != p:
            raise EnumerationError("bernoulli probability is NaN")
        # Same convention as TorchRandomSource: p <= 0 and p >= 1 consume no draw.
        if p <= 0.0:
            return False
        if p >= 1.0:
            return True
        return bool(self._choose([(True, p), (False, 1.0 - p)]))

    def categorical(self, probs: torch.Tensor) -> int:
        values = probs.detach().to("cpu", torch.float64).reshape(-1).tolist()
        if any(not (v >= 0.0) for v in values):
            raise EnumerationError(f"categorical probabilities must be >= 0, got {values}")
        total = sum(values)
        if abs(total - 1.0) > _SUM_TOLERANCE:
            raise EnumerationError(f"categorical probabilities must sum to 1, got {total}")
        branches = [(token, v / total) for token, v in enumerate(values) if v > 0.0]
        return int(self._choose(branches))  # type: ignore[arg-type]


def enumerate_outcomes(
    fn: Callable[[ReplaySource], Outcome], max_runs: int = 1_000_000
) -> dict[Outcome, float]:
    """{outcome: exact probability} of fn(source) over every branch of every draw."""
    distribution: dict[Outcome, float] = defaultdict(float)
    forced: list[int] = []
    runs = 0
    while True:
        runs += 1
        if runs > max_runs:
            raise EnumerationError(f"more than {max_runs} outcomes; shrink the problem")
        source = ReplaySource(forced)
        outcome = fn(source)
        if len(source.choices) < len(forced):
            raise EnumerationError(
                "the function is not deterministic given its draws (fewer draws on replay)"
            )
        distribution[outcome] += source.probability
        # Next prefix: bump the deepest draw that still has an unexplored branch.
        step = len(source.choices) - 1
        while step >= 0 and source.choices[step] + 1 >= source.widths[step]:
            step -= 1
        if step < 0:
            return dict(distribution)
        forced = source.choices[:step] + [source.choices[step] + 1]


def expectation(distribution: dict[Outcome, float], value: Callable[[Outcome], float]) -> float:
    return sum(probability * value(outcome) for outcome, probability in distribution.items())


def max_abs_difference(a: dict[Outcome, float], b: dict[Outcome, float]) -> float:
    return max((abs(a.get(key, 0.0) - b.get(key, 0.0)) for key in set(a) | set(b)), default=0.0)

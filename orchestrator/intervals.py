"""Time-interval arithmetic shared by the loop's statistics and the trace report.

Overlap is "time both the drafter and the verifier were busy": the intersection of the union
of each side's call intervals (a side's own calls may overlap each other, e.g. a pre-draft).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TypeVar

T = TypeVar("T", int, float)


def union(intervals: Iterable[tuple[T, T]]) -> list[tuple[T, T]]:
    """Sorted, disjoint intervals covering the same time (touching intervals merge)."""
    merged: list[tuple[T, T]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def covered(intervals: Iterable[tuple[T, T]]) -> float:
    """Total length of time inside at least one interval."""
    return float(sum(end - start for start, end in union(intervals)))


def intersections(a: Iterable[tuple[T, T]], b: Iterable[tuple[T, T]]) -> list[tuple[T, T]]:
    """The pieces of time inside both unions."""
    out: list[tuple[T, T]] = []
    for s1, e1 in union(a):
        for s2, e2 in union(b):
            start, end = max(s1, s2), min(e1, e2)
            if end > start:
                out.append((start, end))
    return out


def overlap(a: Iterable[tuple[T, T]], b: Iterable[tuple[T, T]]) -> float:
    """Total length of the time inside both unions (in the intervals' unit)."""
    return float(sum(end - start for start, end in intersections(a, b)))

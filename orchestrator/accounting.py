"""What an iteration leaves behind: its IterationRecord, what it adds to the run's GenerationStats, and
to the model pair's calibration counters (added to the store now and then, read back to shape trees).

Counter keys, per method ("{method}:…"): iterations, drafted_tokens, accepted_tokens,
drafted@d / accepted@d (iterations whose draft / accepted path reached depth d + 1), and the rank
statistics R(j) of docs/algorithms.md §6: rank_trials@j (a decided node had a child of rank j)
and rank_hits@j (the accepted child had rank j), read by
scheduling.rank_acceptance_from_calibration.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from orchestrator.run import Run
from orchestrator.timeline import Timeline
from specdec.defaults import DraftSource
from specdec.engine.api import VerifyOutcome
from specdec.errors import StoreUnavailable
from specdec.generation import GenerationStats, IterationRecord, SourceStats
from specdec.trees import DraftTree

log = logging.getLogger(__name__)

CALIBRATION_FLUSH_ITERATIONS = 64  # long requests add their counts to the store this often


@dataclass(frozen=True)
class Tally:
    """What one iteration leaves behind, for the loop to apply: its record (built here, in one place),
    what it adds to the run's statistics, and what it adds to the pair's calibration counts."""

    record: IterationRecord
    stats: GenerationStats
    calibration: Counter


def account(
    run: Run, *, position: int, tree: DraftTree, method: str, k: int, heads: int | None, fallback: bool,
    source: str, outcome: VerifyOutcome, emitted: list[int], started: float, timeline: Timeline,
) -> Tally:
    """The iteration's record and counts: `method` is what ran (the run's method, or "autoregressive"
    for a target-only step), `k` the size its plan asked for, `heads` RD's leading heads."""
    settings = run.settings
    drafted = len(tree) > 0
    accepted = len(outcome.accepted_nodes)
    overlap = timeline.overlap_seconds()
    record = IterationRecord(
        request_id=run.request_id, index=run.state.stats.iterations, position=position, method=method,
        a=settings.a, k=k, heads=heads, drafted=drafted, num_drafted=len(tree), accepted=accepted,
        emitted=emitted, fallback=fallback, start=run.epoch(started), end=run.epoch(time.perf_counter()),
        draft_intervals=[(run.epoch(s), run.epoch(e)) for s, e in timeline.draft],
        verify_intervals=[(run.epoch(s), run.epoch(e)) for s, e in timeline.verify],
        overlap_seconds=overlap, source=str(source) if drafted else "",
    )
    stats = GenerationStats(iterations=1, draft_seconds=timeline.draft_seconds(),
                            verify_seconds=timeline.verify_seconds(), overlap_seconds=overlap,
                            cached_tokens=max(0, int(outcome.cached_tokens)),
                            fallback_iterations=int(fallback))
    calibration: Counter = Counter()
    if drafted:
        stats.drafted_iterations = 1
        stats.drafted_tokens, stats.accepted_tokens = len(tree), accepted
        bump(stats.drafted_per_position, tree.max_depth)
        bump(stats.accepted_per_position, accepted)
        stats.sources[record.source] = SourceStats(drafts=1, drafted_tokens=len(tree),
                                                   accepted_tokens=accepted)
        if record.source == DraftSource.MODEL:  # the pair's calibration is the draft model's acceptance
            count_calibration(calibration, method, tree, outcome.accepted_nodes)
    return Tally(record, stats, calibration)


def count_calibration(counts: Counter, method: str, tree: DraftTree, accepted_nodes: list[int]) -> None:
    """Add one verified draft to the pair's acceptance counters (keys: module docstring)."""
    prefix = f"{method}:"
    accepted = len(accepted_nodes)
    counts[prefix + "iterations"] += 1
    counts[prefix + "drafted_tokens"] += len(tree)
    counts[prefix + "accepted_tokens"] += accepted
    for depth in range(1, tree.max_depth + 1):
        counts[f"{prefix}drafted@{depth - 1}"] += 1
    for depth in range(1, accepted + 1):
        counts[f"{prefix}accepted@{depth - 1}"] += 1
    # Rank statistics R(j): at each decided node, which ranked child (if any) was accepted.
    node = -1
    for depth in range(tree.max_depth + 1):
        children = tree.children(node)
        if not children:
            break
        for rank in range(len(children)):
            counts[f"{prefix}rank_trials@{rank}"] += 1
        chosen = accepted_nodes[depth] if depth < accepted else None
        if chosen is None or chosen not in children:
            break
        counts[f"{prefix}rank_hits@{children.index(chosen)}"] += 1
        node = chosen


class CalibrationStore(Protocol):
    """Where the pair's counts go (orchestrator.store.Store has it)."""

    async def add_calibration(self, pair: str, counts: Mapping[str, int]) -> None: ...


async def flush_calibration(counts: dict[str, int], store: CalibrationStore, pair_key: str) -> None:
    """Add a run's acceptance counts (taken out of its state by the loop) to the model pair's running
    statistics in the store."""
    if not counts:
        return
    try:
        await store.add_calibration(pair_key, counts)
    except StoreUnavailable:  # an outage, which the store logs once: these counts are lost
        log.debug("calibration counts dropped: the request store is unavailable")
    except Exception:  # statistics are not worth failing a request for
        log.exception("could not store calibration counts")


def bump(counts: list[int], upto: int) -> None:
    """counts[i] += 1 for i < upto, growing the list as needed."""
    if len(counts) < upto:
        counts.extend([0] * (upto - len(counts)))
    for i in range(upto):
        counts[i] += 1


def bump_at(counts: list[int], index: int) -> None:
    """counts[index] += 1, growing the list as needed."""
    if len(counts) <= index:
        counts.extend([0] * (index + 1 - len(counts)))
    counts[index] += 1

"""Accounting (orchestrator.accounting): the iteration record, the run's statistics and the
calibration counters, rank statistics R(j) included."""

from __future__ import annotations

import time
from collections import Counter

from orchestrator.accounting import account, bump, bump_at, count_calibration
from orchestrator.timeline import Timeline
from specdec.engine.api import VerifyOutcome
from specdec.generation import GenerationStats, SourceStats, stats_values
from specdec.trees import DraftTree
from tests.orchestrator.helpers import make_run


def test_bump():
    counts: list[int] = [5]
    bump(counts, 3)
    bump_at(counts, 4)
    bump_at(counts, 0)
    assert counts == [7, 1, 1, 0, 1]


def test_rank_statistics_follow_the_accepted_path():
    # root → nodes 0, 1 (ranks 0, 1); node 0 → node 2; node 1 → nodes 3, 4
    tree = DraftTree((1, 2, 3, 4, 5), (-1, -1, 0, 1, 1))
    counts: Counter = Counter()
    count_calibration(counts, "gsd-tree", tree, [1, 4])  # rank 1 at the root, then rank 1 below
    assert counts == Counter({
        "gsd-tree:iterations": 1, "gsd-tree:drafted_tokens": 5, "gsd-tree:accepted_tokens": 2,
        "gsd-tree:drafted@0": 1, "gsd-tree:drafted@1": 1, "gsd-tree:accepted@0": 1, "gsd-tree:accepted@1": 1,
        "gsd-tree:rank_trials@0": 2, "gsd-tree:rank_trials@1": 2, "gsd-tree:rank_hits@1": 2,
    })
    rejected: Counter = Counter()
    count_calibration(rejected, "gsd-tree", tree, [])  # every child of the root rejected
    assert rejected["gsd-tree:rank_trials@0"] == rejected["gsd-tree:rank_trials@1"] == 1
    assert not any(key.startswith("gsd-tree:rank_hits") for key in rejected)


def test_account_returns_the_record_and_what_the_iteration_adds():
    run = make_run(method="token", k=3)
    run.state.generated = [4, 4]
    timeline = Timeline()
    timeline.draft.append((run.state.perf0 + 0.1, run.state.perf0 + 0.3))
    timeline.verify.append((run.state.perf0 + 0.2, run.state.perf0 + 0.5))
    outcome = VerifyOutcome(tokens=[4, 4], accepted_nodes=[0], accept_flags=[True, False], num_drafted=3,
                            committed_len=5)
    tally = account(run, position=3, tree=DraftTree.sequence([4, 1, 2]), method="token", k=3, heads=None,
                    fallback=False, source="model", outcome=outcome, emitted=[4, 4], started=run.state.perf0,
                    timeline=timeline)
    record = tally.record
    assert (record.index, record.position, record.method, record.k) == (0, 3, "token", 3)
    assert (record.drafted, record.num_drafted, record.accepted, record.emitted) == (True, 3, 1, [4, 4])
    assert record.source == "model" and record.a == run.settings.a
    assert abs(record.overlap_seconds - 0.1) < 1e-9 and record.start == run.state.epoch0 <= record.end
    assert record.draft_intervals == [(run.epoch(run.state.perf0 + 0.1), run.epoch(run.state.perf0 + 0.3))]
    stats = tally.stats
    assert (stats.iterations, stats.drafted_tokens, stats.accepted_tokens) == (1, 3, 1)
    assert stats.drafted_per_position == [1, 1, 1] and stats.accepted_per_position == [1]
    assert stats.sources["model"].drafted_tokens == 3 and tally.calibration["token:accepted_tokens"] == 1
    assert run.state.stats == GenerationStats() and run.state.iterations == [] and not run.state.calibration

    fallback = account(run, position=5, tree=DraftTree.empty(), method="autoregressive", k=0, heads=None,
                       fallback=True, source="model", outcome=VerifyOutcome([3], [], [], 0, 6), emitted=[3],
                       started=time.perf_counter(), timeline=Timeline())
    assert fallback.record.fallback and fallback.record.source == "" and not fallback.record.drafted
    counts = fallback.stats
    assert (counts.iterations, counts.fallback_iterations, counts.drafted_iterations) == (1, 1, 0)
    assert not fallback.calibration  # target-only steps are not acceptance data
    stats.add(fallback.stats)
    assert (stats.iterations, stats.fallback_iterations, stats.drafted_iterations) == (2, 1, 1)


def test_stats_add_sums_every_field():
    total = GenerationStats(iterations=2, draft_seconds=0.5, accepted_per_position=[2, 1],
                            pre_draft_bonus_hits=[1], sources={"model": SourceStats(1, 3, 2)})
    total.add(GenerationStats(iterations=1, draft_seconds=0.25, accepted_per_position=[1, 1, 1],
                              pre_draft_bonus_hits=[0, 2], sources={"model": SourceStats(1, 2, 2),
                                                                    "suffix": SourceStats(1, 4, 0)}))
    assert (total.iterations, total.draft_seconds) == (3, 0.75)
    assert total.accepted_per_position == [3, 2, 1] and total.pre_draft_bonus_hits == [1, 2]
    assert total.sources == {"model": SourceStats(2, 5, 4), "suffix": SourceStats(1, 4, 0)}


def test_stats_dict_copies_lists():
    stats = GenerationStats(accepted_per_position=[1, 2])
    as_dict = stats_values(stats)
    stats.accepted_per_position.append(3)
    assert as_dict["accepted_per_position"] == [1, 2] and GenerationStats(**as_dict).iterations == 0

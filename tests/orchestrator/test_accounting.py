"""Accounting (orchestrator.accounting): the iteration record, the run's statistics and the
calibration counters, rank statistics R(j) included."""

from __future__ import annotations

import time
from collections import Counter

from orchestrator.accounting import account, bump, bump_at, count_calibration
from orchestrator.run import stats_dict
from orchestrator.timeline import Timeline
from specdec.engine.api import VerifyOutcome
from specdec.generation import GenerationStats, IterationRecord
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


def test_account_fills_the_record_and_the_statistics():
    run = make_run(method="token", k=3)
    run.state.generated = [4, 4]
    timeline = Timeline()
    timeline.draft.append((run.state.perf0 + 0.1, run.state.perf0 + 0.3))
    timeline.verify.append((run.state.perf0 + 0.2, run.state.perf0 + 0.5))
    record = IterationRecord(request_id=run.request_id, index=0, position=3, method="token", k=3)
    outcome = VerifyOutcome(tokens=[4, 4], accepted_nodes=[0], accept_flags=[True, False], num_drafted=3,
                            committed_len=5)
    account(run, record, tree=DraftTree.sequence([4, 1, 2]), outcome=outcome, emitted=[4, 4],
            started=run.state.perf0, timeline=timeline)
    assert (record.drafted, record.num_drafted, record.accepted, record.emitted) == (True, 3, 1, [4, 4])
    assert abs(record.overlap_seconds - 0.1) < 1e-9 and record.start == run.state.epoch0 <= record.end
    assert record.draft_intervals == [(run.epoch(run.state.perf0 + 0.1), run.epoch(run.state.perf0 + 0.3))]
    stats = run.state.stats
    assert (stats.iterations, stats.new_tokens, stats.drafted_tokens, stats.accepted_tokens) == (1, 2, 3, 1)
    assert stats.drafted_per_position == [1, 1, 1] and stats.accepted_per_position == [1]
    assert run.state.iterations == [record] and run.state.calibration["token:accepted_tokens"] == 1

    fallback = IterationRecord(request_id=run.request_id, index=1, position=5, method="autoregressive",
                               fallback=True)
    account(run, fallback, tree=DraftTree.empty(), outcome=VerifyOutcome([3], [], [], 0, 6), emitted=[3],
            started=time.perf_counter(), timeline=Timeline())
    assert (stats.iterations, stats.fallback_iterations, stats.drafted_iterations) == (2, 1, 1)
    assert run.state.calibration["token:iterations"] == 1  # target-only steps are not acceptance data


def test_stats_dict_copies_lists():
    stats = GenerationStats(accepted_per_position=[1, 2])
    as_dict = stats_dict(stats)
    stats.accepted_per_position.append(3)
    assert as_dict["accepted_per_position"] == [1, 2] and GenerationStats(**as_dict).iterations == 0

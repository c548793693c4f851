"""The mixed benchmark's iteration kinds: which iterations count as drafted, as steps beside a
look-ahead and as plain steps, and the table they make."""

from __future__ import annotations

from bench.bench_mixed import ITERATION_KINDS, iteration_kinds, render_iteration_walls
from specdec.generation import IterationRecord


def record(index: int, *, k: int, num_drafted: int, wall: float) -> IterationRecord:
    method = "token" if num_drafted else "autoregressive"
    return IterationRecord(request_id="r", index=index, position=10 + index, method=method, k=k,
                           drafted=num_drafted > 0, num_drafted=num_drafted, start=100.0, end=100.0 + wall)


def test_iterations_are_split_by_kind_without_the_prefill() -> None:
    records = [
        record(0, k=1, num_drafted=0, wall=1.2),  # the prompt's prefill: left out
        record(1, k=1, num_drafted=1, wall=0.16),
        record(2, k=1, num_drafted=0, wall=0.15),
        record(3, k=0, num_drafted=0, wall=0.11),
        record(4, k=2, num_drafted=2, wall=0.2),
    ]
    kinds = iteration_kinds(records)
    assert list(kinds) == list(ITERATION_KINDS)
    assert [round(w, 6) for w in kinds["drafted"]] == [0.16, 0.2]
    assert [round(w, 6) for w in kinds["step beside a look-ahead"]] == [0.15]
    assert [round(w, 6) for w in kinds["step"]] == [0.11]


def test_the_table_gives_medians_counts_and_the_ratio_to_a_target_only_step() -> None:
    walls = {
        "specdec": {"drafted": [0.15, 0.16, 0.17], "step beside a look-ahead": [0.155], "step": []},
        "target-only": {"drafted": [], "step beside a look-ahead": [], "step": [0.1, 0.1, 0.12]},
    }
    lines = render_iteration_walls(walls)
    rows = [line for line in lines if line.startswith("| specdec") or line.startswith("| target-only")]
    assert rows == [
        "| specdec | 160 (3, 1.60×) | 155 (1, 1.55×) | – |",
        "| target-only | – | – | 100 (3, 1.00×) |",
    ]
    assert render_iteration_walls({}) == []

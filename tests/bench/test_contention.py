"""The contention benchmark on the tiny pair: each model alone, then both at once, one process each."""

from __future__ import annotations

import pytest

from bench.bench_contention import ROLES, main, measure, render


@pytest.mark.slow  # a benchmark run: 18 s (tests/conftest.py, tiers)
def test_measures_each_model_alone_and_beside_the_other(tiny_dirs) -> None:
    dirs = {"draft": str(tiny_dirs["draft"]), "target": str(tiny_dirs["target"])}
    alone = measure(dirs, "float32", context=8, seconds=0.3, together=False)
    together = measure(dirs, "float32", context=8, seconds=0.3, together=True)
    for times in (alone, together):
        assert set(times) == set(ROLES)
        assert all(len(t) >= 3 and min(t) > 0 for t in times.values())
    meta = {"machine": "m", "draft": "d", "target": "t", "dtype": "float32", "context": 8, "seconds": 0.3,
            "command": "python -m bench.bench_contention"}
    rows = [line for line in render(alone, together, meta).splitlines() if line.startswith("| d ")
            or line.startswith("| t ")]
    assert len(rows) == 2 and all(row.endswith("× |") for row in rows)


def test_rejects_a_nonpositive_duration(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["--seconds", "0"])
    assert "--seconds must be > 0" in capsys.readouterr().err

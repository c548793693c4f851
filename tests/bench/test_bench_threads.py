"""bench.bench_threads runs each placement in its own process and reports all three."""

import pytest

from bench import bench_threads


@pytest.mark.slow  # starts processes (tests/conftest.py, tiers)
def test_every_placement_is_measured(tiny_dirs, tmp_path, capsys):
    out = tmp_path / "threads.md"
    assert bench_threads.main(["--target", str(tiny_dirs["target"]), "--dtype", "float32", "--threads", "1",
                               "--tokens", "2", "--repeats", "1", "--out", str(out)]) == 0
    table = out.read_text()
    for placement in bench_threads.PLACEMENTS:
        assert f"| {placement} |" in table
    assert "| main | " in table and "1.00×" in table

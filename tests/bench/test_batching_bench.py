"""bench.bench_batching measures a batched pass and the same plans alone, and leaves caches as found."""

from __future__ import annotations

from bench import bench_batching


def test_measure_times_both_ways_and_undoes_its_extensions(tiny_models):
    model = next(iter(tiny_models.values())).model
    batched, forward, alone = bench_batching.measure(model, 3, [4, 9], 2, repeats=2)
    assert batched > 0 and alone > 0
    assert 0 < forward < batched  # the model's call is part of the batched pass


def test_main_prints_one_row_per_size(tiny_dirs, capsys):
    path = next(iter(tiny_dirs.values()))
    bench_batching.main(["--model", str(path), "--dtype", "float32", "--sizes", "1,2", "--context", "5",
                         "--new", "2", "--repeats", "1"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "ms" in line]
    assert [row.split("|")[1].strip() for row in rows] == ["1", "2"]

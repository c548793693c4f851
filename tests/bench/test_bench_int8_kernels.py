"""bench.bench_int8_kernels on the tiny target: a row per weight shape, every kernel timed
(--exhaustive), a choice."""

from __future__ import annotations

from bench import bench_int8_kernels
from specdec.runtime.int8_kernels import wide_kernels


def test_kernel_table_of_the_tiny_target(tiny_dirs, tmp_path, capsys) -> None:
    out = tmp_path / "kernels.md"
    argv = ["--target", str(tiny_dirs["target"]), "--threads", "1", "--rows", "1,8", "--repeats", "1",
            "--exhaustive", "--out", str(out)]
    assert bench_int8_kernels.main(argv) == 0
    table = [line for line in out.read_text().splitlines() if line.startswith("| ") and "×" in line
             and "K × N" not in line]
    assert table, out.read_text()
    for line in table:
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        assert len(cells) == 4  # shape, 1 row, 8 rows, choice
        for cell in cells[1:3]:
            times = [float(t) for t in cell.split(" / ")]
            assert len(times) == 1 + len(wide_kernels()) and min(times) > 0
        assert cells[3] == "fbgemm only" or " from " in cells[3]
    assert capsys.readouterr().out.strip().startswith("int8 kernels")

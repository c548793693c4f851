"""bench.bench_hop: a unary call and a message on an open stream, each echoed by a real grpc.aio server
on loopback, both measured; bad arguments are refused."""

from __future__ import annotations

import json

import pytest

from bench import bench_hop


def test_both_hops_are_measured_with_and_without_an_interceptor(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_hop.main(["--calls", "40", "--blocks", "2", "--payload-bytes", "64", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"bare", "with a metadata interceptor"}
    for cells in out.values():
        for kind in ("unary", "stream"):
            assert cells[kind]["calls"] == 40
            assert 0 < cells[kind]["median_us"] <= cells[kind]["p90_us"] < 1e6


def test_the_table_names_the_saving(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_hop.main(["--calls", "10", "--blocks", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("| server | unary call") and "saved a hop" in lines[0]
    assert len(lines) == 4


@pytest.mark.parametrize("argv", [["--calls", "0"], ["--blocks", "0"], ["--payload-bytes", "-1"]])
def test_bad_arguments_are_refused(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        bench_hop.main(argv)
    assert exc.value.code == 2

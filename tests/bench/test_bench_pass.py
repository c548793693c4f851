"""bench.bench_pass on the tiny target: one JSON line with the three pass times."""

from __future__ import annotations

import json

from bench import bench_pass


def test_pass_times_of_the_tiny_target(tiny_dirs, capsys) -> None:
    argv = ["--target", str(tiny_dirs["target"]), "--prompt-tokens", "20", "--repeats", "1", "--threads", "1",
            "--json"]
    assert bench_pass.main(argv) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["prompt_tokens"] == 20
    assert result["prefill_s"] > 0 and result["t1_ms"] > 0 and result["t9_ms"] > 0

"""bench.bench_attention on the tiny target: each invariant attention's share of each pass is
measured (the timing hooks sit in the models' attention), and one layer's kernels are timed."""

from __future__ import annotations

import re

from bench import bench_attention


def test_the_attention_share_of_the_tiny_targets_passes(tiny_dirs, tmp_path) -> None:
    out = tmp_path / "attention.md"
    argv = ["--target", str(tiny_dirs["target"]), "--contexts", "24", "--rows", "3", "--repeats", "1",
            "--threads", "1", "--out", str(out)]
    assert bench_attention.main(argv) == 0
    text = out.read_text()
    passes = re.findall(r"^\| 24 \| (.+?) \| ([\d.]+) \| ([\d.]+) \(\d+%\) \| ([\d.]+) \| ([\d.]+) \(\d+%\) "
                        r"\| [\d.]+× \|$", text, re.M)
    assert [name for name, *_ in passes] == ["the prompt's prefill", "1 row", "3 rows"]
    for _, *figures in passes:  # each attention's hook saw its calls, inside the pass
        whole64, attention64, whole_fixed, attention_fixed = map(float, figures)
        assert 0 < attention64 < whole64 and 0 < attention_fixed < whole_fixed
    layers = re.findall(r"^\| (\d+) \| 24 \| [\d.]+ \| [\d.]+ \| [\d.]+ \| [\d.]+ \| [\d.]+× \|$", text, re.M)
    assert layers == ["1", "3"]

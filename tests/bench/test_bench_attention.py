"""bench.bench_attention on the tiny target: the exact attention's share of each pass is measured
(the timing hook sits in the model's attention), and one layer's kernels are timed."""

from __future__ import annotations

import re

from bench import bench_attention


def test_the_attention_share_of_the_tiny_targets_passes(tiny_dirs, tmp_path) -> None:
    out = tmp_path / "attention.md"
    argv = ["--target", str(tiny_dirs["target"]), "--contexts", "24", "--rows", "3", "--repeats", "1",
            "--threads", "1", "--out", str(out)]
    assert bench_attention.main(argv) == 0
    text = out.read_text()
    passes = re.findall(r"^\| 24 \| (.+?) \| ([\d.]+) \| ([\d.]+) \| (\d+)% \|$", text, re.M)
    assert [name for name, *_ in passes] == ["the prompt's prefill", "1 row", "3 rows"]
    for _, whole, attention, _share in passes:
        assert 0 < float(attention) < float(whole)  # the hook saw the attention, inside the pass
    layers = re.findall(r"^\| (\d+) \| 24 \| [\d.]+ \| [\d.]+ \| [\d.]+ \| [\d.]+× \|$", text, re.M)
    assert layers == ["1", "3"]

"""bench.itl_gaps: a request's gaps between iterations that emitted tokens, and what the verifier did
meanwhile, from a trace's spans."""

from __future__ import annotations

import gzip
import json

import pytest

from bench.itl_gaps import gaps, main, report

S = 1_000_000_000


def _iteration(parent: str, end_s: float, emitted: int, source: str | None = None) -> dict:
    attributes = {"specdec.emitted": emitted, "specdec.request_id": parent}
    if source:
        attributes["specdec.source"] = source
    return {"name": "specdec.iteration", "parent_span_id": parent, "start_ns": int((end_s - 0.1) * S),
            "end_ns": int(end_s * S), "attributes": attributes}


def _verify(start_s: float, end_s: float, append: int) -> dict:
    return {"name": "verifier.verify", "parent_span_id": "server", "start_ns": int(start_s * S),
            "end_ns": int(end_s * S), "attributes": {"specdec.append_tokens": append}}


SPANS = [
    _iteration("a", 1.0, 1), _iteration("a", 1.4, 2, "suffix"), _iteration("a", 2.0, 0),
    _iteration("a", 3.0, 1),  # after an iteration that emitted nothing: the gap counts from 1.4
    _iteration("b", 2.9, 3, "suffix"),  # one iteration: no gap
    _verify(1.3, 1.4, 0), _verify(2.1, 3.0, 0), _verify(2.2, 3.001, 0),
    _verify(1.5, 3.5, 300),  # a prompt taken in while the slow pass ran
]


def test_gaps_are_between_iterations_that_emitted() -> None:
    found = sorted(gaps(SPANS), key=lambda gap: gap.end_ns)
    assert [round(gap.seconds, 3) for gap in found] == [0.4, 1.6]
    assert [gap.source for gap in found] == ["suffix", "target-only"]


def test_the_report_names_the_slow_pass_and_the_prompt_in_flight() -> None:
    text = report(SPANS, top=1)
    assert "2 gaps" in text and "suffix: 1 gaps" in text and "target-only: 1 gaps" in text
    assert "gaps from p99 up: 1, of them 1 while the verifier took in a prompt" in text
    assert "1.60 s  target-only a: 2 calls ended with it (longest 0.90 s); prompts in flight 1 (300 tokens)" \
        in text
    assert "no gaps" in report([_iteration("a", 1.0, 1)], top=5)


def test_the_command_reads_a_gzipped_trace_and_refuses_a_missing_one(tmp_path, capsys) -> None:
    path = tmp_path / "trace.jsonl.gz"
    with gzip.open(path, "wt", encoding="utf-8") as handle:
        handle.writelines(json.dumps(span) + "\n" for span in SPANS)
    assert main([str(path), "--top", "2"]) == 0
    assert "2 gaps" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        main([str(tmp_path / "missing.jsonl")])
    assert exc.value.code == 2

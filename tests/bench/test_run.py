"""The benchmark harness end to end on tiny random models (structure, not numbers), and its
overhead accounting on synthetic call logs."""

from __future__ import annotations

import io
import json
from types import SimpleNamespace

import pytest
from rich.console import Console

from bench.run import (
    BenchSettings,
    CallLog,
    build_configs,
    markdown_table,
    parser,
    render_table,
    run_bench,
    settings_from_args,
    to_argv,
)
from orchestrator.intervals import covered


def test_union_length() -> None:
    assert covered([]) == 0.0
    assert covered([(0, 1), (2, 3)]) == pytest.approx(2.0)
    assert covered([(0, 2), (1, 3), (5, 6)]) == pytest.approx(4.0)


def test_overhead_counts_sequential_calls_fully_and_concurrent_ones_once() -> None:
    log = CallLog()
    # sequence method: draft 1.0 s of compute in [0, 1.1], verify 2.0 s in [1.2, 3.3]
    log.calls += [("draft", 0.0, 1.1, 1.0, {}), ("verify", 1.2, 3.3, 1.9, {"verify_seconds": 0.1})]
    log.on_iteration(SimpleNamespace(start=0.0, end=3.5))
    assert log.busy_seconds == pytest.approx(3.0)
    assert log.iteration_seconds - log.busy_seconds == pytest.approx(0.5)
    # RD no-draft step: draft and score concurrently, then a verify that reuses the score
    log.reset()
    log.calls += [
        ("draft", 0.0, 1.0, 0.9, {}),
        ("score", 0.0, 2.0, 0.0, {}),
        ("verify", 2.1, 2.3, 1.8, {"verify_seconds": 0.1, "score_reused": True}),
    ]
    log.on_iteration(SimpleNamespace(start=0.0, end=2.4))
    # busy: draft [0.1, 1.0] ∪ forward [0.2, 2.0] ∪ verify [2.2, 2.3] = 1.9 + 0.1
    assert log.busy_seconds == pytest.approx(2.0)
    assert log.iterations == 1 and not log.calls


def test_cli_arguments_round_trip() -> None:
    args = [
        "--prompts",
        "builtin",
        "--methods",
        "token,rd",
        "--rd-sweep",
        "0.5",
        "--no-grpc",
        "--block-check-k",
        "0",
    ]
    settings = settings_from_args(parser().parse_args(args))
    assert settings.methods == ("token", "rd") and settings.rd_sweep == (0.5,) and not settings.grpc
    assert settings.block_check_k is None
    again = settings_from_args(parser().parse_args(to_argv(settings)))
    assert again == settings
    with pytest.raises(SystemExit):
        settings_from_args(parser().parse_args(["--methods", "warp"]))


def test_configurations_cover_every_method_and_the_sweeps(tiny_analysis) -> None:
    analysis, _ = tiny_analysis
    settings = BenchSettings(
        methods=("token", "block", "ersd", "gsd-tree", "rd", "ersd-tree"),
        rd_sweep=(0.0, 1.0),
        block_check_k=8,
        repeats=3,
        sweep_repeats=1,
    )
    configs = build_configs(settings, analysis)
    names = [c.name for c in configs]
    assert names[0].startswith("baseline") and names[1].startswith("HF assisted")
    kinds = {(c.transport, c.method) for c in configs if c.kind == "pipeline"}
    for method in ("token", "block", "ersd", "gsd-tree", "rd"):
        assert ("inprocess", method) in kinds
    assert ("grpc", "token") in kinds and ("grpc", "rd") in kinds
    sweep = [c for c in configs if c.method == "rd" and c.transport == "inprocess"]
    assert {c.a for c in sweep} >= {0.0, 1.0} and min(c.repeats for c in sweep) == 1
    assert any(c.method == "block" and c.k == 8 for c in configs)
    ersd_tree = [c for c in configs if c.name.startswith("inproc:ersd-tree")]
    assert ersd_tree and ersd_tree[0].method == "ersd" and ersd_tree[0].tree_budget >= 1


def _settings(tiny_dirs, tmp_path, **overrides) -> BenchSettings:
    values = dict(
        draft=str(tiny_dirs["draft"]),
        target=str(tiny_dirs["target"]),
        prompts="builtin",
        num_prompts=2,
        max_new_tokens=6,
        repeats=2,
        analysis_tokens=8,
        rd_sweep=(0.5,),
        block_check_k=3,
        grpc=False,
        out_dir=str(tmp_path / "out"),
        home=str(tmp_path),
    )
    values.update(overrides)
    return BenchSettings(**values)


@pytest.mark.slow  # starts processes (tests/conftest.py, tiers)
def test_bench_runs_end_to_end_in_process(tiny_dirs, tmp_path) -> None:
    settings = _settings(tiny_dirs, tmp_path)
    results = run_bench(settings, progress=lambda message: None)
    out = tmp_path / "out"
    saved = json.loads((out / "results.json").read_text())
    assert set(saved) >= {
        "settings",
        "machine",
        "command",
        "prompts",
        "analysis_key_numbers",
        "configs",
        "summary",
        "runs",
        "seconds",
        "files",
    }
    assert {p.name for p in out.glob("*.png")} == {
        "speedup_vs_k.png",
        "tps_vs_a.png",
        "tokens_vs_budget.png",
        "bench_tps.png",
    }
    summary = {row["name"]: row for row in results["summary"]}
    assert len(summary) == len(results["configs"])
    base = summary["baseline (HF generate)"]
    assert base["speedup"] == pytest.approx(1.0) and base["block_efficiency"] >= 1.0
    for row in summary.values():
        assert row["tokens_per_second"] > 0 and row["decode_tokens_per_second"] > 0
        assert row["runs"] == row["repeats"] * 2
        if row["kind"] == "pipeline":
            assert row["block_efficiency"] >= 1.0
            assert 0.0 <= row["overhead_fraction"] <= 1.0
            assert row["predicted_speedup"] > 0 and row["fraction_of_analytic"] > 0
    # every run produced exactly the tokens asked for (no EOS stop); the decode phase leaves out the
    # step that produced the first token(s)
    for run in results["runs"]:
        assert run["tokens"] == 6 and 0 <= run["decode_tokens"] < 6
        assert 0 <= run["decode_seconds"] < run["seconds"]
    # interleaving: within a round over one prompt every configuration ran once
    first = [r["config"] for r in results["runs"] if r["repeat"] == 0 and r["prompt"] == "builtin/0"]
    assert sorted(first) == sorted(c["name"] for c in results["configs"])
    assert (tmp_path / "calibration").is_dir()
    buffer = io.StringIO()
    render_table(results, Console(file=buffer, width=200))
    assert "baseline" in buffer.getvalue()
    table = markdown_table(results)
    assert table.count("\n") == len(results["summary"]) + 1


@pytest.mark.slow
def test_bench_over_grpc(tiny_dirs, tmp_path) -> None:
    settings = _settings(
        tiny_dirs,
        tmp_path,
        num_prompts=1,
        repeats=1,
        methods=("token", "rd"),
        rd_sweep=(),
        block_check_k=None,
        hf_assisted=False,
        grpc=True,
        grpc_methods=("token", "rd"),
        pipeline_methods=("token", "rd"),
        pipeline_max_k=5,
        pipeline_guesses=("1+0", "2+1", "2+0"),
        server_timeout_s=180.0,
    )
    results = run_bench(settings, progress=lambda message: None)
    grpc_rows = [row for row in results["summary"] if row["transport"] == "grpc"]
    assert {row["method"] for row in grpc_rows} == {"token", "rd"}
    # token: sequential, pipelined with each guess set, adaptive-pipelined; rd: sequential and
    # pipelined with 1 and 2 bonus guesses (it makes no rejection guesses: 2+1 and 2+0 are one row)
    assert sorted((row["method"], row["pipelined"]) for row in grpc_rows) == [
        ("rd", False), ("rd", True), ("rd", True), ("token", False)] + [("token", True)] * 4
    assert any("adaptive ≤5" in row["name"] for row in grpc_rows)
    assert sum("[guesses 2+1]" in row["name"] for row in grpc_rows) == 2  # token and rd
    for row in grpc_rows:
        if row["pipelined"]:
            hits = sum(row["pre_draft_bonus_hits"]) + sum(row["pre_draft_rejection_hits"])
            assert hits == row["pre_drafts_used"], row
    for row in grpc_rows:
        assert row["tokens_per_second"] > 0 and 0.0 <= row["overhead_fraction"] <= 1.0
        if row["pipelined"] and row["method"] == "token":  # rd pipelines only where K = k_max
            assert row["pre_drafts_used"] + row["pre_drafts_dropped"] > 0, row
            assert 0.0 <= row["overlap_share"] <= 1.0 + 1e-9

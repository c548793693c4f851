"""The hostile-client scenarios of issue 29 (bench.reliability_hostile) at their quick size: each runs
against real `specdec serve` / `specdec up` processes on tiny models, returns its figures, and every
goal it measures must hold (a fix that regresses turns its goal false here; nothing is skipped).

The full-size runs give docs/reliability.md's "Hostile clients: measured" figures.
"""

from __future__ import annotations

import shutil

import pytest

from bench import bench_reliability as br
from bench import reliability_hostile as hostile

pytestmark = pytest.mark.slow

# What each scenario's result must hold besides its goals (the report and the docs read them).
KEYS = {
    "slow-reader": {"nonreaders_settled_s", "victim_alone_s", "victim_beside_s", "victim_median_delay_s",
                    "slots_held_while_open", "http_outcomes", "grpc_outcomes", "resumed", "flags"},
    "abort-storm": {"before", "at_once", "after", "seconds_until_back_to_zero_after_raw_aborts",
                    "seconds_until_back_to_zero_after_closes", "sessions_not_released", "openai_stream_close",
                    "request_after_storm"},
    "template-bomb": {"cases", "flags", "rss_cap_mb"},
    "log-flood": {"bad", "unauthenticated", "log_bytes_per_bad_request", "tracebacks", "good_request_after"},
    "supervisor": {"phases", "up_kept_running", "up_exit_code"},
    "redis-hang": {"phases"},
}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> br.Models:
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is not installed: the supervisor and redis-hang scenarios need Redis")
    return br.tiny_models(tmp_path_factory.mktemp("hostile-models"))


def test_every_scenario_is_a_mode_of_the_command_line() -> None:
    assert set(hostile.SCENARIOS) == set(br.HOSTILE) == set(hostile.RUNNERS)
    help_text = br.parser().format_help()
    for name in (*hostile.SCENARIOS, "hostile"):
        assert br.parser().parse_args([name, "--quick"]).mode == name
        assert name in help_text


def test_scrape_sums_a_metric_over_its_labels(tmp_path) -> None:
    page = tmp_path / "metrics"
    page.write_text('# HELP x\nspecdec_active_requests{model="a",method="token"} 2.0\n'
                    'specdec_active_requests{model="a",method="ersd"} 1.0\nspecdec_serving 1.0\n')
    assert hostile.scrape(page.as_uri()) == {"specdec_active_requests": 3.0, "specdec_serving": 1.0}
    assert hostile.scrape(None) == {}


@pytest.mark.parametrize("name", hostile.SCENARIOS)
def test_scenario_runs_quick_and_meets_its_goals(name: str, models: br.Models) -> None:
    lines: list[str] = []
    results = hostile.run_scenario(name, quick=True, models=models, progress=lines.append)
    assert lines, "a scenario says what it is doing"
    assert KEYS[name] <= set(results), KEYS[name] - set(results)
    assert results["size"] == "quick"
    assert results["seconds"] < 600, results["seconds"]  # bounded (a few minutes, on a busy machine)
    goals = results["goals"]
    assert goals and all(isinstance(v, bool) for v in goals.values()), goals
    report = hostile.render(name, results)
    assert report.startswith("| | measured |")
    failed = [goal for goal, met in goals.items() if not met]
    assert not failed, f"{name}: goals not met: {failed}\n{report}"

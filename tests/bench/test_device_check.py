"""The GPU device check (bench/device/run.sh, docs/gpu.md) cannot rot: its CPU dry run runs here.

The dry run is the device check with --device cpu --tiny: every step (environment, the device tests
under pytest, batched vs alone, chi-square through `specdec serve` processes, timings, the loop's
overhead, the projection) runs its real code on tiny shapes and must finish ok. The driver's budget
handling is checked with stand-in steps: a step over its budget is stopped with its children and
the next step still runs. The carried wheels' list must stay well inside the device call's 64 MiB.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from bench.device import check

ROOT = Path(__file__).resolve().parents[2]
WHEELS = ROOT / "bench" / "device" / "wheels.txt"
WHEELS_LIMIT = 40 * 2**20
# The dry run takes about a minute on a quiet 2-core machine; a loaded one can take several.
DRY_RUN_BUDGET_S = 600


@pytest.mark.timeout(DRY_RUN_BUDGET_S + 180)
def test_the_cpu_dry_run_finishes_every_step_ok(tmp_path: Path) -> None:
    out = tmp_path / "out"
    env = {**os.environ, "PYTHON": sys.executable}
    env.pop("OUT", None)
    done = subprocess.run(
        [
            "bash",
            "bench/device/run.sh",
            "--device",
            "cpu",
            "--tiny",
            "--no-wheels",
            "--budget-s",
            str(DRY_RUN_BUDGET_S),
            "--out",
            str(out),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=DRY_RUN_BUDGET_S + 120,
        stdin=subprocess.DEVNULL,
    )
    log = (out / "steps.log").read_text(errors="replace")[-4000:] if (out / "steps.log").exists() else ""
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:] + log
    report = json.loads((out / "report.json").read_text())
    steps = report["steps"]
    assert list(steps) == list(check.STEP_NAMES)
    for name, result in steps.items():
        assert result["status"] == "ok", (name, result.get("error"), log)
        assert result["markdown"].strip(), name
    # The deterministic checks must also pass (the chi-square's verdict is statistical: reported only).
    for name in ("env", "exactness", "batched"):
        assert steps[name]["data"]["verdict"] == "pass", (name, steps[name]["findings"])
    assert steps["exactness"]["data"]["runs"][-1]["passed"] >= 1  # the device test the dry run runs
    assert {r["k"] for r in steps["overhead"]["data"]["rows"]} == {2}
    # The pooled path ran (eagerly on the CPU): its rows equal the eager cache's, alone and batched.
    for model in steps["captured"]["data"]["models"].values():
        assert model["passes_after_rows"]["eager"] > 0
        assert all(row["max_tv"] < 1e-5 for row in model["rows"].values()), model["rows"]
    loop = {(r["method"], r["k"]): r for r in steps["loop"]["data"]["rows"]}
    assert set(loop) == {("autoregressive", 0), ("token", 2)}
    assert 0 < loop[("token", 2)]["acceptance"] <= 1 and loop[("token", 2)]["projection"] > 0
    assert "**Projected, not measured.**" in steps["projection"]["markdown"]
    markdown = (out / "report.md").read_text()
    for name in check.STEP_NAMES:
        assert re.search(rf"^\| {name} \| ok \|", markdown, re.MULTILINE), name
        assert f"## {name}: " in markdown


def _stand_in(tmp_path: Path, name: str, body: str) -> check.Step:
    (tmp_path / f"{name}.py").write_text(body)
    return check.Step(name, 1.0, f"stand-in {name}", module=name)


SLEEPER = """
import subprocess, sys, time
from pathlib import Path
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
Path(sys.argv[sys.argv.index("--result") + 1]).with_suffix(".child").write_text(str(child.pid))
time.sleep(120)
"""
WRITER = """
import sys
from bench.device.common import StepResult, run_step
sys.exit(run_step(lambda args: StepResult("stand-in section", {"verdict": "pass"}, ["one finding"])))
"""
CRASHER = """
import sys
from bench.device.common import run_step
def step(args):
    raise RuntimeError("the device is on fire")
sys.exit(run_step(step))
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state not in ("Z", "X")


@pytest.mark.timeout(180)
@pytest.mark.slow  # starts processes (tests/conftest.py, tiers)
def test_a_step_over_its_budget_is_stopped_with_its_children_and_the_next_steps_still_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    steps = (
        _stand_in(tmp_path, "sleeper", SLEEPER),
        _stand_in(tmp_path, "crasher", CRASHER),
        _stand_in(tmp_path, "writer", WRITER),
    )
    monkeypatch.setattr(check, "STEPS", steps)
    monkeypatch.setattr(check, "STEP_NAMES", tuple(s.name for s in steps))
    monkeypatch.setattr(check, "MIN_STEP_S", 1.0)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), str(ROOT)]))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the driver's results folder lands here
    out = tmp_path / "out"
    start = time.monotonic()
    code = check.main(["--device", "cpu", "--tiny", "--budget-s", "24", "--out", str(out)])
    assert time.monotonic() - start < 120
    assert code == 1  # not every step finished ok
    report = json.loads((out / "report.json").read_text())["steps"]
    assert report["sleeper"]["status"] == "timeout"
    assert "stopped after its budget" in report["sleeper"]["error"]
    assert report["crasher"]["status"] == "failed"
    assert "the device is on fire" in report["crasher"]["error"]
    assert report["writer"]["status"] == "ok" and report["writer"]["findings"] == ["one finding"]
    (child_file,) = tmp_path.glob("specdec-device-check-*/sleeper.child")
    pid = int(child_file.read_text())
    deadline = time.monotonic() + 15
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(pid), "the timed-out step's child outlived it"
    markdown = (out / "report.md").read_text()
    assert "| sleeper | timeout |" in markdown and "| writer | ok | pass |" in markdown
    assert "Traceback" not in markdown


def _wheel_list() -> list[tuple[str, str, int]]:
    rows = []
    for line in WHEELS.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            requirement, size = line.split()
            name, _, version = requirement.partition("==")
            rows.append((name.lower().replace("_", "-"), version, int(size)))
    return rows


def test_the_carried_wheels_are_pinned_once_each_and_stay_under_40_mib() -> None:
    rows = _wheel_list()
    names = [name for name, _, _ in rows]
    assert rows and len(names) == len(set(names)), "one version of each package"
    assert all(version and size > 0 for _, version, size in rows), "pinned, with their sizes"
    assert sum(size for _, _, size in rows) < WHEELS_LIMIT
    folder = ROOT / ".whl"  # present only where bench/device/fetch_wheels.sh ran (never in CI)
    if folder.is_dir():
        files = list(folder.glob("*.whl"))
        assert sum(f.stat().st_size for f in files) < WHEELS_LIMIT
        stems = [f.name.split("-")[0].lower().replace("_", "-") for f in files]
        assert len(stems) == len(set(stems)), f"two versions of one package in .whl/: {sorted(stems)}"


def test_the_pass_profile_runs_on_a_tiny_shape_and_separates_the_three_paths(tmp_path: Path) -> None:
    """bench.device.profile_pass (run by hand on a lent GPU, bench/RESULTS.md "GPU check") stays runnable:
    it times plain HF, the tree cache and the batcher on one shape and writes the operator table."""
    from bench.device import profile_pass

    assert profile_pass.main(["--out", str(tmp_path), "--models", "tiny-target", "--device", "cpu",
                              "--context", "16"]) == 0
    (result,) = json.loads((tmp_path / "profile.json").read_text())
    for path in ("plain_hf", "tree_cache", "tree_cache_batcher"):
        assert 0 < result[path] < 5, (path, result[path])
    assert result["per_pass_counts"]["aten::copy_"] > 0  # the profiler saw the model's operators
    assert "Self CPU" in (tmp_path / "profile-tiny-target.txt").read_text()

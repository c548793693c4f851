"""Step "exactness": the test suite's device-aware tests, run on the device by pytest.

Tests marked `device` load their tiny models on SPECDEC_TEST_DEVICE (tests/conftest.py); the files
holding them are found by their marker, so a test made device-aware later is picked up without an
edit here. tests/runtime/test_int8_invariance.py's pass-shape comparison runs beside them (bfloat16
on CUDA: it prints how far rows move between pass shapes). The dry run (--tiny) collects the `device`
tests and runs the last one collected (their full CPU run belongs to the ordinary suite).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ElementTree
from pathlib import Path

from bench.device.common import StepArgs, StepResult, log, run_step, table

ROOT = Path(__file__).resolve().parents[2]
PASS_SHAPES = "tests/runtime/test_int8_invariance.py::test_pass_shapes_at_the_test_devices_fast_precision"
MARKER = re.compile(r"pytest\.mark\.device\b")


def device_test_files() -> list[str]:
    """Test files holding a `device` mark (text search: nothing is imported)."""
    return sorted(
        str(path.relative_to(ROOT))
        for path in (ROOT / "tests").rglob("test_*.py")
        if MARKER.search(path.read_text(errors="replace"))
    )


def pytest_run(label: str, argv: list[str], args: StepArgs, timeout_s: float) -> dict:
    """Run pytest with `argv`; counts from its JUnit XML (collected counts from -q output)."""
    report = Path(tempfile.mkdtemp(prefix="specdec-device-pytest-")) / "junit.xml"
    env = {**os.environ, "SPECDEC_TEST_DEVICE": args.device, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "--tb=short",
        "-p",
        "no:cacheprovider",
        f"--junitxml={report}",
        "-o",
        "junit_logging=no",
        *argv,
    ]
    log(f"exactness: {label}: {' '.join(command[3:])}")
    try:
        done = subprocess.run(
            command,
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired as exc:
        log((exc.stdout or b"")[-3000:].decode(errors="replace") if isinstance(exc.stdout, bytes) else "")
        return {
            "label": label,
            "rc": None,
            "passed": 0,
            "failed": 0,
            "skipped": 0,
            "errors": 0,
            "tail": f"stopped after {timeout_s:.0f} s",
            "ids": [],
        }
    failures = done.stdout.find("= FAILURES =")
    if failures >= 0:  # the tracebacks come before the durations, out of the tail's reach
        log(done.stdout[failures:failures + 8000])
    log(done.stdout[-6000:] + done.stderr[-3000:])
    counts = {"passed": 0, "failed": 0, "skipped": 0, "errors": 0}
    if report.exists():
        suite = ElementTree.parse(report).getroot()
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
        if suite is not None:
            total = int(suite.get("tests", 0))
            counts.update(
                failed=int(suite.get("failures", 0)),
                errors=int(suite.get("errors", 0)),
                skipped=int(suite.get("skipped", 0)),
            )
            counts["passed"] = total - counts["failed"] - counts["errors"] - counts["skipped"]
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    ids = [line for line in lines if "::" in line and " " not in line]  # --collect-only -q lists ids
    return {"label": label, "rc": done.returncode, **counts, "tail": lines[-1] if lines else "", "ids": ids}


def step(args: StepArgs) -> StepResult:
    files = device_test_files()
    if not files:
        raise RuntimeError("no test file holds a `device` mark")
    runs = []
    if args.tiny:
        collected = pytest_run(
            "device tests (collected)",
            ["-m", "device", "--collect-only", *files],
            args,
            max(10.0, args.left_s() / 2),
        )
        runs.append(collected)
        ids = collected.pop("ids", [])
        if not ids:
            raise RuntimeError("no test marked `device` was collected")
        runs.append(pytest_run("one device test", [ids[-1]], args, max(10.0, args.left_s() - 5)))
    else:
        runs.append(
            pytest_run(
                "device tests",
                ["-m", "device", "--timeout", "120", *files],
                args,
                max(10.0, args.left_s() - 35),
            )
        )
        runs.append(pytest_run("pass shapes", ["-s", PASS_SHAPES], args, max(10.0, args.left_s() - 5)))
    for run in runs:
        run.pop("ids", None)
    # rc 5: nothing collected (a collect-only run reports its tests as collected, not passed)
    broken = [r for r in runs if r["rc"] not in (0, 5) or r["failed"] or r["errors"]]
    verdict = "fail" if broken else "pass"
    rows = [
        [r["label"], r["rc"], r["passed"], r["failed"], r["errors"], r["skipped"], r["tail"]] for r in runs
    ]
    text = (
        f"`SPECDEC_TEST_DEVICE={args.device} python -m pytest ...` on the files marked `device` "
        f"({', '.join(files)})"
        + (" (dry run: collected, and the last one run)" if args.tiny else f" and `{PASS_SHAPES}`")
        + ".\n\n"
        + table(["run", "rc", "passed", "failed", "errors", "skipped", "pytest's last line"], rows)
    )
    findings = [f"{r['label']}: {r['tail']}" for r in runs]
    if broken:
        findings.insert(0, "FAIL: " + ", ".join(r["label"] for r in broken))
    return StepResult(text, {"files": files, "runs": runs, "verdict": verdict}, findings)


if __name__ == "__main__":
    sys.exit(run_step(step, description=__doc__))

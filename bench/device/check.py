"""The device check's driver: runs each step in its own process within its time budget, then writes
one markdown report and one JSON file (bench/device/run.sh calls it; docs/gpu.md describes it).

A step over its budget is stopped (its whole process group: services and pytest included) and
reported as "timeout"; a step that fails is reported as "failed" with its error; the others still run.
Budgets are shares of --budget-s, and what a step leaves unspent goes to the steps after it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Step:
    name: str
    share: float  # of the total budget
    what: str
    module: str = ""  # the module run as `python -m`; default bench.device.<name>

    @property
    def target(self) -> str:
        return self.module or f"bench.device.{self.name}"


STEPS = (
    Step("env", 0.04, "machine, packages, serving imports, GPU ceilings"),
    Step("exactness", 0.14, "the suite's device-aware tests under pytest on the device"),
    Step("batched", 0.05, "batched pass vs alone: rows and seeded outcomes, per precision"),
    Step("fidelity", 0.20, "chi-square per method through `specdec serve` processes (captured passes)"),
    Step("captured", 0.17, "T(n) eager vs captured, capture cost, padded/batched rows, k-step draft"),
    Step("loop", 0.17, "the loop end to end, drafter and verifier as processes (two pairs) vs target-only"),
    Step("timings", 0.10, "eager T(n), tree, batched passes and the drafter's step at real shapes"),
    Step("overhead", 0.08, "per-iteration overhead of the loop over gRPC, draft = target, captured passes"),
    Step("projection", 0.05, "projected speedup (§7) with the measured times, speed-of-light bound"),
)
STEP_NAMES = tuple(step.name for step in STEPS)
MIN_STEP_S = 30.0  # a step is a Python process importing torch: never less


def run_one(step: Step, budget_s: float, args: argparse.Namespace, results: Path, log) -> dict:
    """Run one step's module within `budget_s`; its result (or why there is none)."""
    result_file = results / f"{step.name}.json"
    argv = [
        sys.executable,
        "-m",
        step.target,
        "--device",
        args.device,
        "--budget-s",
        f"{budget_s:.0f}",
        "--result",
        str(result_file),
        "--inputs",
        str(results),
    ]
    if args.tiny:
        argv.append("--tiny")
    log.write(f"\n===== step {step.name} (budget {budget_s:.0f} s): {' '.join(argv[1:])}\n")
    log.flush()
    start = time.monotonic()
    process = subprocess.Popen(
        argv,
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        process.wait(timeout=budget_s)
        status = None
    except subprocess.TimeoutExpired:
        status = "timeout"
    finally:
        # The step's own children (services, pytest) are in its process group: none outlives it.
        try:
            os.killpg(process.pid, signal.SIGTERM if process.poll() is None else signal.SIGKILL)
            if process.poll() is None:
                try:
                    process.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    os.killpg(process.pid, signal.SIGKILL)
                    process.wait(timeout=10)
        except ProcessLookupError:
            pass
    seconds = round(time.monotonic() - start, 1)
    if status == "timeout":
        result_file.unlink(missing_ok=True)  # a partial result is not a result
        return {
            "status": "timeout",
            "seconds": seconds,
            "budget_s": round(budget_s),
            "error": f"stopped after its budget of {budget_s:.0f} s",
            "markdown": "",
            "data": {},
            "findings": [],
        }
    if not result_file.exists():
        return {
            "status": "failed",
            "seconds": seconds,
            "budget_s": round(budget_s),
            "error": f"exited with {process.returncode} and wrote no result",
            "markdown": "",
            "data": {},
            "findings": [],
        }
    result = json.loads(result_file.read_text())
    result.update(seconds=seconds, budget_s=round(budget_s))
    return result


def verdict_of(result: dict) -> str:
    if result["status"] != "ok":
        return "–"
    return str(result.get("data", {}).get("verdict", "measured"))


def summary(meta: dict, results: dict[str, dict]) -> list[str]:
    """The report's head: the command, one row per step, the findings."""
    dry = " (dry run, tiny shapes)" if meta["tiny"] else ""
    lines = [
        f"# Device check ({meta['date']})",
        "",
        f"Command: `{meta['command']}`; device {meta['device']}{dry}; "
        f"budget {meta['budget_s']:.0f} s, spent {meta['seconds']:.0f} s.",
        "",
        "| step | status | verdict | seconds | budget | what |",
        "|---|---|---|---:|---:|---|",
    ]
    for step in STEPS:
        r = results[step.name]
        lines.append(
            f"| {step.name} | {r['status']} | {verdict_of(r)} | {r['seconds']} | {r['budget_s']} | "
            f"{step.what} |"
        )
    findings = [f"- {step.name}: {line}" for step in STEPS for line in results[step.name].get("findings", [])]
    if findings:
        lines += ["", "## Findings", "", *findings]
    return lines


def render(meta: dict, results: dict[str, dict]) -> str:
    """The whole report: the summary, then each step's section."""
    lines = summary(meta, results)
    for step in STEPS:
        r = results[step.name]
        lines += ["", f"## {step.name}: {step.what}", ""]
        if r["status"] != "ok":
            lines.append(f"**{r['status']}**: {r.get('error', '')}")
        else:
            lines.append(r["markdown"])
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--device",
        default="cuda",
        choices=("cuda", "cpu"),
        help="cuda: the GPU check; cpu: the dry run (with --tiny)",
    )
    parser.add_argument("--tiny", action="store_true", help="tiny model shapes and few repeats (the dry run)")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=480.0,
        help="total seconds for all steps (default 480: fits a 10-minute device call)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="folder for report.md, report.json and steps.log (default: $OUT)",
    )
    parser.add_argument(
        "--steps",
        default=",".join(STEP_NAMES),
        help=f"comma-separated subset of the steps, in this order: {','.join(STEP_NAMES)}",
    )
    args = parser.parse_args(argv)
    out = args.out or (Path(os.environ["OUT"]) if os.environ.get("OUT") else None)
    if out is None:
        parser.error("give --out DIR (or set $OUT)")
    chosen = [s.strip() for s in args.steps.split(",") if s.strip()]
    unknown = sorted(set(chosen) - set(STEP_NAMES))
    if unknown:
        parser.error(f"unknown steps {', '.join(unknown)}; the steps are {', '.join(STEP_NAMES)}")
    out.mkdir(parents=True, exist_ok=True)
    results_dir = Path(tempfile.mkdtemp(prefix="specdec-device-check-"))
    start = time.monotonic()
    results: dict[str, dict] = {}
    with open(out / "steps.log", "w") as log:
        for i, step in enumerate(STEPS):
            if step.name not in chosen:
                results[step.name] = {
                    "status": "skipped",
                    "seconds": 0,
                    "budget_s": 0,
                    "error": "not chosen",
                    "markdown": "",
                    "data": {},
                    "findings": [],
                }
                continue
            left = args.budget_s - (time.monotonic() - start)
            shares = sum(s.share for s in STEPS[i:] if s.name in chosen)
            budget = max(MIN_STEP_S, left * step.share / shares)
            results[step.name] = run_one(step, budget, args, results_dir, log)
            print(
                f"device check: {step.name}: {results[step.name]['status']} in "
                f"{results[step.name]['seconds']} s",
                file=sys.stderr,
                flush=True,
            )
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "device": args.device,
        "tiny": args.tiny,
        "budget_s": args.budget_s,
        "seconds": time.monotonic() - start,
        "command": "bash bench/device/run.sh " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    report = render(meta, results)
    (out / "report.md").write_text(report)
    (out / "report.json").write_text(json.dumps({"meta": meta, "steps": results}, indent=1, default=str))
    print(report)
    # The device call's reply shows the end of the output: the summary again, last.
    print("\n".join(summary(meta, results)))
    return 0 if all(r["status"] in ("ok", "skipped") for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())

"""What every step of the device check shares: its command line, its result file, its clock.

A step is a module run as `python -m bench.device.<step> --device D [--tiny] --budget-s S --result F
--inputs DIR`. It writes one JSON object to F: {"status": "ok" | "failed", "markdown": a section of
the report, "data": numbers for report.json, "findings": one line per verdict}. The driver
(bench.device.check) runs each step in its own process group so that a step over its budget can be
stopped without losing the others.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@dataclass
class StepArgs:
    device: str
    tiny: bool
    budget_s: float
    result: Path
    inputs: Path
    started: float = field(default_factory=time.monotonic)

    def left_s(self) -> float:
        """Seconds of this step's budget still unspent (the driver kills the step at zero)."""
        return self.budget_s - (time.monotonic() - self.started)

    @property
    def cuda(self) -> bool:
        return self.device.startswith("cuda")

    def earlier(self, step: str) -> dict[str, Any] | None:
        """The result of an earlier step of this run (None when it did not run or failed)."""
        path = self.inputs / f"{step}.json"
        if not path.exists():
            return None
        result = json.loads(path.read_text())
        return result if result.get("status") == "ok" else None


@dataclass
class StepResult:
    markdown: str
    data: dict[str, Any]
    findings: list[str] = field(default_factory=list)


def parse(argv: list[str] | None, description: str) -> StepArgs:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--device", default="cuda", help="cuda (the GPU check) or cpu (the dry run)")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes and few repeats: the CPU dry run")
    parser.add_argument("--budget-s", type=float, default=120.0, help="seconds this step may take")
    parser.add_argument("--result", type=Path, required=True, help="JSON file this step writes")
    parser.add_argument("--inputs", type=Path, default=None, help="folder of earlier steps' results")
    args = parser.parse_args(argv)
    return StepArgs(args.device, args.tiny, args.budget_s, args.result, args.inputs or args.result.parent)


def run_step(
    step: Callable[[StepArgs], StepResult], argv: list[str] | None = None, description: str = ""
) -> int:
    """Run `step` and write its result file; an exception is a failed step with its message (the
    traceback goes to the step's log, never into the report's table)."""
    args = parse(argv, description)
    try:
        result = step(args)
        payload = {
            "status": "ok",
            "markdown": result.markdown,
            "data": result.data,
            "findings": result.findings,
        }
        code = 0
    except Exception as exc:  # noqa: BLE001 - a failed step is reported, the check goes on
        traceback.print_exc()
        payload = {
            "status": "failed",
            "error": f"{type(exc).__name__}: {exc}"[:2000],
            "markdown": "",
            "data": {},
            "findings": [],
        }
        code = 1
    payload["seconds"] = round(time.monotonic() - args.started, 2)
    args.result.parent.mkdir(parents=True, exist_ok=True)
    args.result.write_text(json.dumps(payload, indent=1, default=str))
    return code


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def synchronize(device: str) -> None:
    """Wait for the device's queued work (a host clock read right after it is then meaningful)."""
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def median_seconds(
    run: Callable[[], Any], device: str, repeats: int, warmup: int = 1, after: Callable[[], Any] | None = None
) -> float:
    """Median wall seconds of `run` (device synchronised before and after each), after `warmup`
    untimed runs; `after` runs untimed after each (e.g. a cache rollback)."""
    times = []
    for i in range(warmup + repeats):
        synchronize(device)
        start = time.perf_counter()
        run()
        synchronize(device)
        if i >= warmup:
            times.append(time.perf_counter() - start)
        if after is not None:
            after()
    return statistics.median(times)


def ms(seconds: float | None, digits: int = 2) -> str:
    return "–" if seconds is None else f"{1000 * seconds:.{digits}f}"


def table(header: list[str], rows: list[list[Any]]) -> str:
    """A markdown table (first column left-aligned, the rest right-aligned)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)

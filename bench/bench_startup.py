"""Start-up cost of the light client: wall time of fresh interpreters, runs interleaved, medians.

    python -m bench.bench_startup --runs 9 --out bench/results/startup-DATE/

Rows: `import specdec.client` (the light client: grpc + protobuf, no torch), `import torch` (what
any torch-importing client pays first), `specdec generate --address 127.0.0.1:1 x` (the CLI in
server mode, up to its one-line "no orchestrator answers" error: parse, client, one failed
connection), and `import specdec.client` by `-X importtime`'s own total (no interpreter start).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = {
    "import specdec.client": [sys.executable, "-c", "import specdec.client"],
    "import torch": [sys.executable, "-c", "import torch"],
    "specdec generate --address 127.0.0.1:1 x": [sys.executable, "-m", "specdec.cli", "generate",
                                                 "--address", "127.0.0.1:1", "x"],
}


def _env() -> dict[str, str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", NO_COLOR="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def wall(argv: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(argv, cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   stdin=subprocess.DEVNULL, timeout=120)
    return time.perf_counter() - start


def importtime_total(module: str) -> float:
    """Cumulative import time of `module` as -X importtime reports it (seconds)."""
    result = subprocess.run([sys.executable, "-X", "importtime", "-c", f"import {module}"], cwd=ROOT,
                            env=_env(), capture_output=True, text=True, timeout=120)
    for line in result.stderr.splitlines():
        match = re.match(r"import time:\s+\d+ \|\s+(\d+) \|\s+(\S+)$", line)
        if match and match.group(2) == module:
            return int(match.group(1)) / 1e6
    raise RuntimeError(f"-X importtime printed no line for {module}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=9, help="runs of each command (interleaved)")
    parser.add_argument("--out", type=Path, default=None, help="folder for startup.json and startup.md")
    args = parser.parse_args()
    times: dict[str, list[float]] = {name: [] for name in COMMANDS}
    times["-X importtime: specdec.client"] = []
    for run in range(args.runs):
        for name, argv in COMMANDS.items():
            times[name].append(wall(argv))
        times["-X importtime: specdec.client"].append(importtime_total("specdec.client"))
        print(f"run {run + 1}/{args.runs}", file=sys.stderr)
    rows = {name: {"median_s": statistics.median(v), "min_s": min(v), "max_s": max(v), "runs": v}
            for name, v in times.items()}
    command = f"python -m bench.bench_startup --runs {args.runs}" + (f" --out {args.out}" if args.out else "")
    lines = [f"`{command}`", "", "| what | median (s) | min | max |", "|---|---:|---:|---:|"]
    lines += [f"| `{name}` | {r['median_s']:.3f} | {r['min_s']:.3f} | {r['max_s']:.3f} |"
              for name, r in rows.items()]
    print("\n".join(lines))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "startup.json").write_text(json.dumps({"command": command, "rows": rows}, indent=2))
        (args.out / "startup.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

"""Three rounds of the side-by-side from two runs of bench_grounded (`side-by-side/`, one round, and
`side-by-side-2/`, two more; the same command but --rounds and --out): the second run's rounds are
renumbered after the first's, then the bench's own summary, tables and greedy-text check run over
all of them, plus the default's ratio to HF prompt lookup per run.

    PYTHONPATH=. python bench/results/zen4-2026-12-04c/combine_rounds.py
"""

import json
import statistics
from pathlib import Path

from bench import bench_grounded as bg

HERE = Path(__file__).parent


def main() -> None:
    names = ("side-by-side", "side-by-side-2")
    runs = [json.loads((HERE / name / "results.json").read_text()) for name in names]
    details, offset = [], 0
    for run in runs:
        rounds = {row["round"] for row in run["details"]}
        details += [{**row, "round": row["round"] + offset} for row in run["details"]]
        offset += len(rounds)
    meta = {**runs[0]["meta"], "rounds": offset,
            "command": " and ".join(run["meta"]["command"] for run in runs)}
    configs, temperatures = meta["configs"], [float(t) for t in meta["temperatures"]]
    results = {"summary": bg.summarize(details, configs, temperatures),
               "greedy_text": bg.agreement(details, configs), "details": details}
    lines = [bg.render(results, meta), "", "## The default ÷ HF prompt lookup, per run", ""]
    for temperature in temperatures:
        for workload in ("grounded", "open"):
            pairs: dict[tuple[str, int], dict[str, float]] = {}
            for row in details:
                if row["temperature"] == temperature and row["workload"] == workload:
                    pairs.setdefault((row["item"], row["round"]), {})[row["config"]] = row["tok_s"]
            ratios = sorted(p["specdec"] / p["hf-lookup"] for p in pairs.values())
            lines.append(f"- T = {temperature:g}, {workload}: median {statistics.median(ratios):.2f} over "
                         f"{len(ratios)} runs (range {ratios[0]:.2f}–{ratios[-1]:.2f})")
    out = HERE / "side-by-side-3rounds.md"
    out.write_text("\n".join(lines) + "\n")
    print(out.read_text())


if __name__ == "__main__":
    main()

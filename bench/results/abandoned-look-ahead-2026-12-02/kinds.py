"""Per run: specdec ÷ plain HF (overall, and the median prompt of each round), iterations by source,
and from the run's traces the target-only steps (k = 0), the steps beside a look-ahead (k ≥ 1, nothing
drafted) and the model's iterations, with their median wall time. The traces (5 MB a run) were not
kept; the runs' figures are in kinds.txt. Run from the repo root:

    python bench/results/abandoned-look-ahead-2026-12-02/kinds.py A1 B1 B2 A2 B3 A3
"""

from __future__ import annotations

import glob
import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).parent


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def main(runs: list[str]) -> None:
    for run in runs:
        data = json.loads((HERE / run / "results.json").read_text())
        table = data["summary"]["table"]["0"]["open"]
        hf = {(x["round"], x["item"]): x["tok_s"] for x in data["details"] if x["config"] == "hf"}
        ratios: dict[int, list[float]] = {0: [], 1: []}
        for x in data["details"]:
            if x["config"] == "specdec":
                ratios[x["round"]].append(x["tok_s"] / hf[(x["round"], x["item"])])
        alone, beside, model = [], [], []
        for path in glob.glob(str(HERE / run / "trace-A-*.jsonl")):
            for line in open(path, encoding="utf-8"):
                span = json.loads(line)
                attributes = span["attributes"]
                request = attributes.get("specdec.request_id", "")
                if span["name"] != "specdec.iteration" or "warmup" in request or "flush" in request:
                    continue
                ms = (span["end_ns"] - span["start_ns"]) / 1e6
                if attributes["specdec.num_drafted"] == 0:
                    (alone if attributes["specdec.k"] == 0 else beside).append(ms)
                elif attributes.get("specdec.source") == "model":
                    model.append(ms)
        print(f"{run}: specdec/hf overall {table['specdec']['ratio']:.3f}  round0 median "
              f"{_median(ratios[0]):.3f} round1 median {_median(ratios[1]):.3f} | its "
              f"{table['specdec']['iterations_by_source']} | k=0 steps {len(alone)} med "
              f"{_median(alone):.0f} ms; step-aheads {len(beside)} med {_median(beside):.0f}; "
              f"model its {len(model)} med {_median(model):.0f}")


if __name__ == "__main__":
    main(sys.argv[1:])

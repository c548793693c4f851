"""Cached TTFT ÷ the new tokens alone, per turn and run, from the runs' results.json (bench_prefix).
Run from the repo root:

    python bench/results/first-token-2026-12-02/ratios.py A1 B1 A2 B2
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).parent


def main(runs: list[str]) -> None:
    pooled: dict[tuple[str, int], list[float]] = {}
    for run in runs:
        rows = json.loads((HERE / run / "results.json").read_text())["rows"]
        for turn in sorted({row["turn"] for row in rows if row["turn"] >= 2}):
            mine = [row for row in rows if row["turn"] == turn]
            ratios = [row["ttft_cached"] / row["ttft_new"] for row in mine]
            pooled.setdefault((run[0], turn), []).extend(ratios)
            print(f"{run} turn {turn}: median {statistics.median(ratios):.2f} over {len(ratios)} rounds "
                  f"({' '.join(f'{r:.2f}' for r in ratios)}); cached ms "
                  f"{' '.join(str(round(1e3 * row['ttft_cached'])) for row in mine)}; new alone ms "
                  f"{' '.join(str(round(1e3 * row['ttft_new'])) for row in mine)}")
    for (side, turn), ratios in sorted(pooled.items()):
        print(f"all {side} turn {turn}: median {statistics.median(ratios):.2f} over {len(ratios)} rounds")


if __name__ == "__main__":
    main(sys.argv[1:])

"""Cached TTFT ÷ the new tokens alone, per turn and run, from bench_prefix runs' results.json, and
pooled per side (a run folder's first letter: A1 and A2 are side A). Run from the repo root:

    python -m bench.prefix_ratios bench/results/turn-close-2026-12-02/{A1,B1,A2,B2}
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def main(runs: list[str]) -> None:
    pooled: dict[tuple[str, int], list[float]] = {}
    for run in map(Path, runs):
        rows = json.loads((run / "results.json").read_text())["rows"]
        for turn in sorted({row["turn"] for row in rows if row["turn"] >= 2}):
            mine = [row for row in rows if row["turn"] == turn]
            ratios = [row["ttft_cached"] / row["ttft_new"] for row in mine]
            pooled.setdefault((run.name[0], turn), []).extend(ratios)
            print(f"{run.name} turn {turn}: median {statistics.median(ratios):.2f} over {len(ratios)} rounds "
                  f"({' '.join(f'{r:.2f}' for r in ratios)}); cached ms "
                  f"{' '.join(str(round(1e3 * row['ttft_cached'])) for row in mine)}; new alone ms "
                  f"{' '.join(str(round(1e3 * row['ttft_new'])) for row in mine)}; cached tokens "
                  f"{mine[0]['cached_tokens']} of {mine[0]['prompt_tokens']}, {mine[0]['new_tokens']} new")
    for (side, turn), ratios in sorted(pooled.items()):
        print(f"all {side} turn {turn}: median {statistics.median(ratios):.2f} over {len(ratios)} rounds")


if __name__ == "__main__":
    main(sys.argv[1:])

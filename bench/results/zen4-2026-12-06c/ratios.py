"""Per-run ratios of one configuration to another on the same prompt, temperature and round, from a
bench_grounded results.json: median and range per temperature.

    cd bench/results/zen4-2026-12-06c && python ratios.py grounded-3rounds specdec hf-lookup
"""

import json
import statistics
import sys
from pathlib import Path


def main() -> None:
    run_dir, top, bottom = sys.argv[1:4]
    details = json.loads((Path(run_dir) / "results.json").read_text())["details"]
    rate = {(d["config"], d["temperature"], d["item"], d["round"]): d["tok_s"] for d in details}
    for temperature in sorted({d["temperature"] for d in details}):
        ratios = [value / rate[(bottom, t, item, rnd)] for (config, t, item, rnd), value in rate.items()
                  if config == top and t == temperature and (bottom, t, item, rnd) in rate]
        print(f"T = {temperature:g}: {top} / {bottom} median {statistics.median(ratios):.2f}x "
              f"({min(ratios):.2f}-{max(ratios):.2f}, {len(ratios)} runs)")


if __name__ == "__main__":
    main()

"""Per configuration, each run's tok/s in two result folders (same prompt and temperature), and the
median of the per-run ratios B / A:

    python bench/results/zen4-2026-12-06d/ab_pairs.py A_DIR B_DIR
"""
import json
import statistics
import sys
from collections import defaultdict

a_dir, b_dir = sys.argv[1], sys.argv[2]
runs = {}
for name, folder in (("A", a_dir), ("B", b_dir)):
    for d in json.load(open(f"{folder}/results.json"))["details"]:
        runs[(name, d["config"], d["temperature"], d["item"], d["round"])] = d["tok_s"]
ratios = defaultdict(list)
for (name, config, temperature, item, rnd), tok_s in runs.items():
    if name == "A" and ("B", config, temperature, item, rnd) in runs:
        ratios[(config, temperature)].append(runs[("B", config, temperature, item, rnd)] / tok_s)
for (config, temperature), values in sorted(ratios.items()):
    a, b = (statistics.median(v for k, v in runs.items() if k[:3] == (side, config, temperature))
            for side in "AB")
    print(f"{config:10s} T = {temperature:g}: tok/s median A {a:.2f}, B {b:.2f}; B / A per run median "
          f"{statistics.median(values):.2f}x ({min(values):.2f}-{max(values):.2f}, {len(values)} runs)")

"""The verifier's verify_seconds by draft size from a trace file (`bench_grounded --trace`).

    python bench/results/zen4-2026-12-04/verification_spans.py TRACE.jsonl [...]
"""

import json
import statistics
import sys
from collections import defaultdict


def main() -> None:
    for name in sys.argv[1:]:
        by_size: dict[int, list[float]] = defaultdict(list)
        for line in open(name):
            span = json.loads(line)
            if span["name"] != "verifier.verify":
                continue
            attributes = span["attributes"]
            size = min(attributes.get("specdec.num_drafted", 0), 20) // 4 * 4
            by_size[size].append(attributes["specdec.verification_seconds"] * 1e3)
        print(name, {size: (round(statistics.median(v), 3), len(v)) for size, v in sorted(by_size.items())})


if __name__ == "__main__":
    main()

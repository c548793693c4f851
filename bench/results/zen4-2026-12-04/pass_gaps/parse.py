"""Medians of the gap between passes, and of each call's mark after the previous pass's end."""

import statistics
import sys
from collections import defaultdict

WITHIN_MS = 50  # longer gaps are between requests


def main() -> None:
    for name in sys.argv[1:]:
        events = [(kind, float(stamp)) for kind, stamp, _thread in (line.split() for line in open(name))]
        gaps: list[float] = []
        after: dict[str, list[float]] = defaultdict(list)
        last_end = None
        for kind, stamp in events:
            if kind == "pass_end":
                last_end = stamp
                continue
            if last_end is None:
                continue
            ms = (stamp - last_end) * 1e3
            if ms < WITHIN_MS:
                (gaps if kind == "pass_begin" else after[kind]).append(ms)
            if kind == "pass_begin":
                last_end = None
        gaps.sort()
        p10, p90 = gaps[len(gaps) // 10], gaps[9 * len(gaps) // 10]
        print(f"{name} gap end->begin median {statistics.median(gaps):.2f} ms p10 {p10:.2f} p90 {p90:.2f} "
              f"n={len(gaps)}")
        for kind, values in after.items():
            median = statistics.median(values)
            print(f"   {kind:14s} after pass_end: median {median:.2f} ms (n={len(values)})")


if __name__ == "__main__":
    main()

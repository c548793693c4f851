"""Median and minimum forward time of the served 1-row verify passes (no draft) in a trace file."""

import json
import statistics
import sys

passes = []
with open(sys.argv[1]) as spans:
    for line in spans:
        span = json.loads(line)
        if span["name"] != "verifier.verify":
            continue
        attributes = span["attributes"]
        if attributes.get("specdec.tree_size") == 0 and attributes.get("specdec.append_tokens", 0) <= 1:
            passes.append(1e3 * attributes["specdec.forward_seconds"])
print(f"{sys.argv[1]}: {len(passes)} target-only passes, median {statistics.median(passes):.1f} ms, "
      f"min {min(passes):.1f} ms")

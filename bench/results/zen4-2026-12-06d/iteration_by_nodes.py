"""Served iterations' wall time by drafted nodes, from a bench_grounded --trace run's spans (the
prompt's pass left out), and what the prompt pass's draft did:

    python bench/results/zen4-2026-12-06d/iteration_by_nodes.py TRACE.jsonl[.gz]
"""
import gzip
import json
import statistics
import sys
from collections import defaultdict

path = sys.argv[1]
spans = [json.loads(line) for line in (gzip.open if path.endswith(".gz") else open)(path, "rt")]
iterations = [s for s in spans if s["name"] == "specdec.iteration"]
real = [s for s in iterations
        if not any(word in s["attributes"]["specdec.request_id"] for word in ("flush", "warmup"))]
by_nodes = defaultdict(list)
first = []
for span in real:
    attributes = span["attributes"]
    if attributes["specdec.iteration"] == 0:
        first.append((attributes["specdec.num_drafted"], attributes["specdec.accepted"]))
        continue
    by_nodes[attributes["specdec.num_drafted"]].append((span["end_ns"] - span["start_ns"]) / 1e6)
print("drafted nodes: iterations, median ms")
for nodes, times in sorted(by_nodes.items()):
    print(f"{nodes:3d}: {len(times):3d}, {statistics.median(times):6.1f}")
print("prompt passes (drafted nodes, accepted):", first)

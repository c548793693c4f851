"""The suffix proposer replayed over greedy outputs (greedy_outputs.py): per proposal its match
length, its promise (Σ of path probabilities) and what a T = 0 verify would accept; printed by
match length, own tokens only and with the other prompts' texts cached (suffix-replay.txt).

    python suffix_replay.py greedy.json rows.json
"""

import collections
import json
import sys

from specdec.model_free import Proposal, SuffixCache


def accepted_of(proposal: Proposal, future: list[int]) -> int:
    """The longest path of the proposal's tree that `future` follows."""
    children: dict[int, dict[int, int]] = collections.defaultdict(dict)
    for i, (token, parent) in enumerate(zip(proposal.tokens, proposal.parents, strict=True)):
        children[parent][token] = i
    node, count = -1, 0
    for token in future:
        if token not in children[node]:
            break
        node, count = children[node][token], count + 1
    return count


def bucket(match: int) -> int:
    return match if match <= 4 else 8 if match < 8 else 16 if match < 16 else 64


def replay(data: list[dict], with_cache: bool) -> list[dict]:
    rows = []
    for k, item in enumerate(data):
        cache = SuffixCache()
        if with_cache:
            for j, other in enumerate(data):
                if j != k:
                    cache.start(("o", j), other["prompt"])
                    cache.sync(("o", j), other["prompt"] + other["output"])
                    cache.finish(("o", j))
        cache.start(("r", k), item["prompt"])
        out = item["output"]
        for position in range(len(out)):
            cache.sync(("r", k), item["prompt"] + out[:position])
            proposal = cache.propose(("r", k), max_nodes=16)
            if proposal is not None:
                rows.append({"cache": with_cache, "workload": item["workload"], "match": proposal.match_len,
                             "expected": proposal.expected_accepted(),
                             "accepted": accepted_of(proposal, out[position:])})
    return rows


def main() -> None:
    with open(sys.argv[1]) as file:
        data = json.load(file)
    rows = replay(data, False) + replay(data, True)
    with open(sys.argv[2], "w") as file:
        json.dump(rows, file)
    for with_cache in (False, True):
        print("cache of the other items" if with_cache else "own tokens only")
        for workload in ("open", "grounded"):
            groups = collections.defaultdict(list)
            for row in rows:
                if row["cache"] == with_cache and row["workload"] == workload:
                    groups[bucket(row["match"])].append(row)
            print(f"  {workload}: positions with a proposal {sum(len(v) for v in groups.values())}")
            for size in sorted(groups):
                group = groups[size]
                promise = sum(r["expected"] for r in group)
                accepted = sum(r["accepted"] for r in group)
                print(f"    match<= {size:2d}: n={len(group):4d} mean promise {promise / len(group):5.2f} "
                      f"mean accepted {accepted / len(group):5.2f}  "
                      f"accepted/promise {accepted / promise:5.2f}  "
                      f"share accepting>=1 {sum(r['accepted'] > 0 for r in group) / len(group):.2f}")


if __name__ == "__main__":
    main()

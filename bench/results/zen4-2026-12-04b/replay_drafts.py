"""Model-free drafts replayed over known greedy continuations, no model: at each iteration the
proposer sees the committed tokens, its whole proposal is checked against the continuation (the
accepted path), and the iteration costs W(rows) = 78 + 4.5·max(0, rows − 2) ms (fitted to the
served iterations of extract and code-edit on this CPU, `iterations.txt`). Suffix drafts (our
default source: a tree, depth match + DEPTH_OFFSET, 16 nodes) with offsets 2 (the default), 4, 8,
64; prompt lookup (HF's kind: a chain of 10 or 16 tokens, n-grams up to 2 or 4).

    PYTHONPATH=. python bench/results/zen4-2026-12-04b/replay_drafts.py greedy_outputs.json 64
    PYTHONPATH=. python bench/results/zen4-2026-12-04b/replay_drafts.py hf_greedy_outputs.json 64
"""

import json
import sys
from pathlib import Path

import specdec.model_free as model_free
from specdec.model_free import PromptLookup, SuffixCache

HERE = Path(__file__).parent
POLICIES = [("suffix", 2, 16), ("suffix", 4, 16), ("suffix", 8, 16), ("suffix", 64, 16),
            ("lookup", 2, 10), ("lookup", 4, 10), ("lookup", 4, 16)]


def pass_ms(rows: int) -> float:
    return 78 + 4.5 * max(0, rows - 2)


def accepted(tokens: list[int], parents: list[int], truth: list[int]) -> int:
    """Depth of the tree path that follows `truth`."""
    node, depth = -1, 0
    while depth < len(truth):
        children = [i for i, p in enumerate(parents) if p == node and tokens[i] == truth[depth]]
        if not children:
            break
        node, depth = children[0], depth + 1
    return depth


def replay(prompt: list[int], output: list[int], policy: tuple[str, int, int]) -> tuple[int, float]:
    """(iterations, modelled decode ms: every iteration after the prompt's)."""
    kind, size, nodes = policy
    if kind == "suffix":
        model_free.DEPTH_OFFSET = size
        cache = SuffixCache(max_requests=0, max_tokens=0, max_depth=nodes)
        cache.start("request", prompt)
    else:
        lookup = PromptLookup(min_ngram=1, max_ngram=size, max_tokens=nodes)
    position, iterations, ms = 0, 0, 0.0
    while position < len(output):
        committed = prompt + output[:position]
        if kind == "suffix":
            cache.sync("request", committed)
            proposal = cache.propose("request", max_nodes=nodes)
        else:
            lookup.sync(committed)
            proposal = lookup.propose(max_tokens=nodes)
        tokens, parents = (list(proposal.tokens), list(proposal.parents)) if proposal else ([], [])
        took = min(accepted(tokens, parents, output[position:]), len(output) - position - 1)
        iterations += 1
        ms += pass_ms(len(tokens) + 1) if iterations > 1 else 0.0
        position += took + 1
    return iterations, ms


def main() -> None:
    data = json.loads((HERE / sys.argv[1]).read_text())
    new_tokens = int(sys.argv[2])
    names = [f"{kind}{size}/{nodes}" for kind, size, nodes in POLICIES]
    print(f"{'item':22}", " ".join(f"{name:14}" for name in names))
    totals = dict.fromkeys(POLICIES, 0.0)
    for item, entry in data.items():
        cells = []
        for policy in POLICIES:
            iterations, ms = replay(entry["prompt"], entry["output"][:new_tokens], policy)
            if item.startswith("grounded"):
                totals[policy] += ms
            cells.append(f"{iterations:3d} it {ms:5.0f} ms")
        print(f"{item:22}", " ".join(f"{cell:14}" for cell in cells))
    print(f"{'grounded, ms':22}", " ".join(f"{totals[policy]:<14.0f}" for policy in POLICIES))


if __name__ == "__main__":
    main()

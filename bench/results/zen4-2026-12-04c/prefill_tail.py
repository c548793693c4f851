"""A new prompt's first verify pass as a served verifier runs it (models on one ComputeThread, the
ragged batcher, a fresh cache), alternated in one process: `tail` (this tree: all but a tail of up
to a chunk prefilled, the tail with the tree) against `last` (before: all but the last token
prefilled, the last alone with the tree), with no draft and with a 5-token chain; and plain HF's
per-tensor model making the same first token in one pass.

    PYTHONPATH=. python bench/results/zen4-2026-12-04c/prefill_tail.py 427,200 6
"""

import statistics
import sys
import time

import torch
from served_engine import served_engine

import specdec.runtime.scoring as scoring
from specdec.runtime.kv import TreeKVCache
from specdec.trees import DraftTree

TAIL = scoring.prepare


def prepare_last(kv, committed, max_pending=None):
    """The rule before this tree: all but the last uncached token prefilled first."""
    reused = min(kv.common_prefix(committed), len(committed) - 1)
    kv.truncate(reused)
    restored = kv.restore_prefix(committed[:-1])
    reused = kv.prefix_len
    pending = list(committed[reused:])
    limit = max_pending if max_pending is not None else kv.pending_limit(scoring.MAX_PENDING)
    if len(pending) > max(1, limit):
        kv.prefill(pending[:-1])
        pending = pending[-1:]
    return scoring.Prepared(reused, pending, restored)


def main() -> None:
    lengths, rounds = [int(n) for n in sys.argv[1].split(",")], int(sys.argv[2])
    compute, ours, hf, batcher = served_engine()
    vocab = ours.info.vocab_size
    chain = DraftTree.sequence([11, 12, 13, 14, 15])

    for n in lengths:
        prompt = [(1000 + (i * 37) % 5000) % vocab for i in range(n)]

        def hf_pass(prompt=prompt) -> None:
            with torch.inference_mode():
                hf.model(torch.tensor([prompt]), use_cache=True, logits_to_keep=1)

        def ours_pass(rule, tree, prompt=prompt):
            scoring.prepare = rule
            kv = TreeKVCache(ours.model)
            kv.runner = batcher
            with torch.inference_mode():
                return scoring.score_tree(kv, prompt, tree).logits

        variants = {"hf": lambda: compute.call(hf_pass),
                    "last, no draft": lambda: ours_pass(prepare_last, DraftTree.empty()),
                    "tail, no draft": lambda: ours_pass(TAIL, DraftTree.empty()),
                    "last, 5-token chain": lambda: ours_pass(prepare_last, chain),
                    "tail, 5-token chain": lambda: ours_pass(TAIL, chain)}
        rows = {name: variants[name]() for name in variants if name != "hf"}  # warm-up, and the rows
        assert torch.equal(rows["last, no draft"], rows["tail, no draft"])
        assert torch.equal(rows["last, 5-token chain"], rows["tail, 5-token chain"])
        wall: dict[str, list[float]] = {k: [] for k in variants}
        for rnd in range(rounds):
            names = list(variants) if rnd % 2 == 0 else list(reversed(variants))
            for name in names:
                began = time.perf_counter()
                variants[name]()
                wall[name].append(time.perf_counter() - began)
        print(f"{n} tokens (rows bitwise equal under both rules):")
        for name, values in wall.items():
            print(f"  {name:20s} median {statistics.median(values):.3f} min {min(values):.3f}",
                  [round(v, 3) for v in values], flush=True)
    scoring.prepare = TAIL


if __name__ == "__main__":
    main()

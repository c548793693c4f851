"""Greedy verification of a 16-node chain draft (5 accepted) on one thread, the default target's
vocabulary: the general path (warp to one-hot rows, then ERSD's rule) against greedy_descent.

    PYTHONPATH=. python bench/results/zen4-2026-12-04/greedy_verification.py
"""

from __future__ import annotations

import statistics
import time

import torch

from specdec.sampling import SamplingParams, warp_logits
from specdec.trees import DraftTree
from specdec.verification.base import MethodParams, greedy_descent
from specdec.verification.dispatch import verify

VOCAB, NODES = 151_936, 16


def median_ms(fn, repeats: int = 50) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        fn()
        times.append(time.perf_counter() - began)
    return 1e3 * statistics.median(times)


def main() -> None:
    torch.set_num_threads(1)
    logits = torch.randn(NODES + 1, VOCAB)
    best = logits.argmax(-1).tolist()
    tokens = [best[i] for i in range(5)] + [(best[5] + 1) % VOCAB] + [1] * (NODES - 6)
    tree = DraftTree(tuple(tokens), tuple(range(-1, NODES - 1)))
    greedy, params = SamplingParams(temperature=0.0), MethodParams(seed=1, position=100)

    def general():
        return verify("ersd", tree, warp_logits(logits, greedy), None, params, None, deterministic=True)

    assert general() == greedy_descent(tree, logits)
    fast = median_ms(lambda: greedy_descent(tree, logits))
    print(f"general path {median_ms(general):.2f} ms, greedy_descent {fast:.3f} ms")


if __name__ == "__main__":
    main()

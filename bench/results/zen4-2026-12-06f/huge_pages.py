"""Transparent huge pages for the weights a pass streams, in one process: every VNNI-packed weight
of the default target held twice, in ordinary 4 KiB pages and in a mapping advised for huge pages
(specdec.runtime.huge_pages), and the passes run on one copy or the other, swapped round by round
(the order alternating); one-, four- and ten-row passes after a 500-token prompt, the median of 8
passes a round. Processes on this host fall into a fast and a slow mode for one-row passes
(~45 against ~65 ms, alternating from one process to the next whatever the tree), so only a
comparison inside one process says what the pages do. Run from the repo root:

    PYTHONPATH=. python bench/results/zen4-2026-12-06f/huge_pages.py 8
"""

import statistics
import sys
import time

import torch

from bench.bench_grounded import load_hf_target
from bench.bench_pass import prompt_ids
from specdec.defaults import DEFAULT_TARGET_MODEL
from specdec.models import resolve_model
from specdec.runtime.int8_kernels import products
from specdec.runtime.kv import TreeKVCache


def main(rounds: int) -> None:
    loaded = load_hf_target(resolve_model(DEFAULT_TARGET_MODEL), "int8", 2)
    model, vocab = loaded.model, loaded.info.vocab_size
    held = [p for p in products(model) if p._vnni is not None]
    copies = {"huge": [p._vnni for p in held], "4k": [(p._vnni[0].clone(), p._vnni[1]) for p in held]}
    with open("/proc/self/smaps_rollup") as smaps:
        huge = next(line for line in smaps if line.startswith("AnonHugePages"))
    print(f"{len(held)} VNNI weights; {huge.strip()}")
    times: dict[tuple[str, int], list[float]] = {(label, n): [] for label in copies for n in (1, 4, 10)}
    with torch.inference_mode():
        kv = TreeKVCache(model)
        kv.prefill(prompt_ids(vocab, 500))
        for round_ in range(rounds):
            for label in ("4k", "huge") if round_ % 2 == 0 else ("huge", "4k"):
                for product, weight in zip(held, copies[label], strict=True):
                    product._vnni = weight
                for n in (1, 4, 10):
                    tokens, parents = [t % vocab for t in range(600, 600 + n)], list(range(-1, n - 1))
                    passes = []
                    for _ in range(8):
                        began = time.perf_counter()
                        kv.extend(tokens, parents)
                        kv.settle([])
                        passes.append(time.perf_counter() - began)
                    times[(label, n)].append(statistics.median(passes))
    for n in (1, 4, 10):
        small, huge_ = times[("4k", n)], times[("huge", n)]
        ratios = ", ".join(f"{h / s:.2f}" for s, h in zip(small, huge_, strict=True))
        print(f"T({n}): 4 KiB pages {1e3 * statistics.median(small):.1f} ms, huge pages "
              f"{1e3 * statistics.median(huge_):.1f} ms; per round huge/4k: {ratios}")


if __name__ == "__main__":
    main(int(sys.argv[1]))

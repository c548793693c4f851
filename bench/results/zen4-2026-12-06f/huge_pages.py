"""Transparent huge pages for the weights a pass streams, in one process: every VNNI-packed weight
of the default target held twice, in ordinary 4 KiB pages and in a mapping advised for huge pages
(specdec.runtime.huge_pages), and the passes run on one copy or the other, swapped round by round
(the order alternating); one-, four- and ten-row passes after a 500-token prompt, the median of 8
passes a round. Processes on this host fall into a fast and a slow mode for one-row passes
(~45 against ~65 ms, alternating from one process to the next whatever the tree), so only a
comparison inside one process says what the pages do. Run from the repo root:

    PYTHONPATH=. python bench/results/zen4-2026-12-06f/huge_pages.py 8
"""

import sys

from bench.bench_grounded import load_hf_target
from bench.bench_pass import swap_report, swapped_in_one_process
from specdec.defaults import DEFAULT_TARGET_MODEL
from specdec.models import resolve_model
from specdec.runtime.int8_kernels import products


def main(rounds: int) -> None:
    loaded = load_hf_target(resolve_model(DEFAULT_TARGET_MODEL), "int8", 2)
    model, vocab = loaded.model, loaded.info.vocab_size
    held = [p for p in products(model) if p._vnni is not None]
    copies = {"huge": [p._vnni for p in held], "4k": [(p._vnni[0].clone(), p._vnni[1]) for p in held]}
    with open("/proc/self/smaps_rollup") as smaps:
        huge = next(line for line in smaps if line.startswith("AnonHugePages"))
    print(f"{len(held)} VNNI weights; {huge.strip()}")

    def switch(label: str) -> None:
        for product, weight in zip(held, copies[label], strict=True):
            product._vnni = weight

    times = swapped_in_one_process(model, vocab, ("4k", "huge"), switch, rounds, (1, 4, 10))
    print("\n".join(swap_report(times, ("4k", "huge"), ("4 KiB pages", "huge pages"), (1, 4, 10))))

if __name__ == "__main__":
    main(int(sys.argv[1]))

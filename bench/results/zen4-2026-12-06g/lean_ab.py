"""In one process: the engines' pass through transformers' forward (SPECDEC_LEAN_FORWARD=0) against
the lean forward (specdec.runtime.lean_forward), switched round by round (the order alternating);
1-, 4-, 10- and 16-row passes after a 500-token prompt, the median of 8 passes a round. Run from the
repo root:

    PYTHONPATH=. python bench/results/zen4-2026-12-06g/lean_ab.py 8
"""

import os
import sys

from bench.bench_grounded import load_hf_target
from bench.bench_pass import swap_report, swapped_in_one_process
from specdec.defaults import DEFAULT_TARGET_MODEL
from specdec.models import resolve_model
from specdec.runtime import lean_forward

WIDTHS = (1, 4, 10, 16)


def main(rounds: int) -> None:
    loaded = load_hf_target(resolve_model(DEFAULT_TARGET_MODEL), "int8", 2)
    assert lean_forward.supports(loaded.model)

    def switch(label: str) -> None:
        os.environ[lean_forward.ENV] = "1" if label == "lean" else "0"

    times = swapped_in_one_process(loaded.model, loaded.info.vocab_size, ("transformers", "lean"), switch,
                                   rounds, WIDTHS)
    print("\n".join(swap_report(times, ("transformers", "lean"), ("transformers' forward", "lean"), WIDTHS)))


if __name__ == "__main__":
    main(int(sys.argv[1]))

"""Pass times by width in one process, kernels alternated round by round: fbgemm for every call,
specdec's VNNI kernel from 2 rows on (every shape), and the engine's measured choice (read from
the saved int8-kernels file, as an engine start does). Run from the repo root:

    SPECDEC_INT8_KERNELS=fbgemm PYTHONPATH=. \
        python bench/results/zen4-2026-12-06d/pass_widths.py [rounds] [widths]
"""
import sys

from bench.bench_grounded import load_hf_target
from bench.bench_pass import alternated_passes, median_line
from specdec.defaults import DEFAULT_TARGET_MODEL, specdec_home
from specdec.models import resolve_model
from specdec.runtime.int8 import VNNI
from specdec.runtime.int8_kernels import CACHE_FILE, choose_kernels, products

rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 8
loaded = load_hf_target(resolve_model(DEFAULT_TARGET_MODEL), "int8", 2)
model = loaded.model
widths = tuple(int(w) for w in sys.argv[2].split(",")) if len(sys.argv) > 2 else (1, 3, 5, 9, 17, 33)
setups = {"fbgemm": None, "vnni": 2, "chosen": "chosen"}


def use(name):
    rows = setups[name]
    if rows == "chosen":
        choose_kernels(model, specdec_home() / CACHE_FILE, mode="auto")
        return
    for product in products(model):
        product.run_wide_from(rows, VNNI) if rows is not None else product.run_wide_from(None)


times = alternated_passes(model, loaded.info.vocab_size, list(setups), use, rounds, widths)
print("median over", rounds, "rounds (prefill: s, 500 tokens; T(n): ms)")
for name in setups:
    print(median_line(name, times[name]))

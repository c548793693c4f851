"""Pass times by width in one process under three kernel choices, alternated round by round:
fbgemm for every call; the choice the engine made before the grid flushed the caches (VNNI from
1 row for qkv, 4 for gate+up, 9 for the vocabulary, 16 for down, fbgemm for o: the saved
int8-kernels-4.json on this Zen 4); and the engine's choice now (measured here with the caches
flushed, as an engine start does). Also the process's resident memory after each switch.
Run from the repo root:

    PYTHONPATH=. python bench/results/zen4-2026-12-06e/pass_choices.py [rounds] [widths]
"""
import resource
import sys
from pathlib import Path

from bench.bench_grounded import load_hf_target
from bench.bench_pass import alternated_passes, median_line
from specdec.defaults import DEFAULT_TARGET_MODEL
from specdec.models import resolve_model
from specdec.runtime.int8 import VNNI
from specdec.runtime.int8_kernels import choose_kernels, products

rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 6
widths = tuple(int(w) for w in sys.argv[2].split(",")) if len(sys.argv) > 2 else (1, 4, 10, 16)
loaded = load_hf_target(resolve_model(DEFAULT_TARGET_MODEL), "int8", 2)
model = loaded.model
now = choose_kernels(model, Path("/tmp/pass-choices-kernels.json"), mode="auto")
print("the engine's choice now:", now)
before = {"1536x2048": 1, "1536x17920": 4, "1536x151936": 9, "8960x1536": 16, "1536x1536": None}
setups = {"fbgemm": {}, "before": before, "now": {s: c[1] for s, c in now.items() if c}}
memory = {}


def rss_gib() -> float:
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmRSS"))
    return int(line.split()[1]) / 2**20


def use(name):
    for product in products(model):
        rows = setups[name].get(f"{product.shape[0]}x{product.shape[1]}")
        product.run_wide_from(rows, VNNI) if rows else product.run_wide_from(None)
    memory[name] = rss_gib()


times = alternated_passes(model, loaded.info.vocab_size, list(setups), use, rounds, widths)
print("median over", rounds, "rounds (prefill: s, 500 tokens; T(n): ms); RSS after the switch (GiB)")
for name in setups:
    print(median_line(name, times[name]), f"RSS={memory[name]:.2f}")
print("peak RSS (GiB):", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20)

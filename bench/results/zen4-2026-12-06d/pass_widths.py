"""Pass times by width in one process, kernels alternated round by round: fbgemm for every call,
specdec's VNNI kernel from 2 rows on (every shape), and the engine's measured choice (read from
the saved int8-kernels file, as an engine start does). Run from the repo root:

    SPECDEC_INT8_KERNELS=fbgemm PYTHONPATH=. \
        python bench/results/zen4-2026-12-06d/pass_widths.py [rounds] [widths]
"""
import statistics
import sys
import time

import torch

from bench.bench_grounded import load_hf_target
from specdec.defaults import DEFAULT_TARGET_MODEL, specdec_home
from specdec.models import resolve_model
from specdec.runtime.int8 import VNNI
from specdec.runtime.int8_kernels import CACHE_FILE, choose_kernels, products
from specdec.runtime.kv import TreeKVCache

rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 8
loaded = load_hf_target(resolve_model(DEFAULT_TARGET_MODEL), "int8", 2)
model = loaded.model
vocab = loaded.info.vocab_size
prompt = [(1000 + (i * 37) % 5000) % vocab for i in range(500)]
widths = tuple(int(w) for w in sys.argv[2].split(",")) if len(sys.argv) > 2 else (1, 3, 5, 9, 17, 33)
setups = {"fbgemm": None, "vnni": 2, "chosen": "chosen"}
times = {name: {w: [] for w in ("prefill", *widths)} for name in setups}


def use(rows):
    if rows == "chosen":
        choose_kernels(model, specdec_home() / CACHE_FILE, mode="auto")
        return
    for product in products(model):
        product.run_wide_from(rows, VNNI) if rows is not None else product.run_wide_from(None)


with torch.inference_mode():
    for r in range(rounds + 1):
        for name, rows in (list(setups.items()) if r % 2 else list(reversed(setups.items()))):
            use(rows)
            kv = TreeKVCache(model)
            began = time.perf_counter()
            kv.prefill(prompt)
            if r:
                times[name]["prefill"].append(time.perf_counter() - began)
            for n in widths:
                for _ in range(3):
                    began = time.perf_counter()
                    kv.extend([t % vocab for t in range(600, 600 + n)], list(range(-1, n - 1)))
                    if r:
                        times[name][n].append(time.perf_counter() - began)
                    kv.settle([])
print("median over", rounds, "rounds (prefill: s, 500 tokens; T(n): ms)")
for name in setups:
    print(f"{name:7s}", " ".join(
        f"{w if w == 'prefill' else f'T({w})'}={statistics.median(v) * (1 if w == 'prefill' else 1e3):.3f}"
        for w, v in times[name].items()))

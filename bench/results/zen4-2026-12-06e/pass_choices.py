"""Pass times by width in one process under three kernel choices, alternated round by round:
fbgemm for every call; the choice the engine made before the grid flushed the caches (VNNI from
1 row for qkv, 4 for gate+up, 9 for the vocabulary, 16 for down, fbgemm for o: the saved
int8-kernels-4.json on this Zen 4); and the engine's choice now (measured here with the caches
flushed, as an engine start does). Also the process's resident memory after each switch.
Run from the repo root:

    PYTHONPATH=. python bench/results/zen4-2026-12-06e/pass_choices.py [rounds] [widths]
"""
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

from bench.bench_grounded import load_hf_target
from specdec.defaults import DEFAULT_TARGET_MODEL
from specdec.models import resolve_model
from specdec.runtime.int8 import VNNI
from specdec.runtime.int8_kernels import choose_kernels, products
from specdec.runtime.kv import TreeKVCache

rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 6
widths = tuple(int(w) for w in sys.argv[2].split(",")) if len(sys.argv) > 2 else (1, 4, 10, 16)
loaded = load_hf_target(resolve_model(DEFAULT_TARGET_MODEL), "int8", 2)
model = loaded.model
vocab = loaded.info.vocab_size
now = choose_kernels(model, Path("/tmp/pass-choices-kernels.json"), mode="auto")
print("the engine's choice now:", now)
before = {"1536x2048": 1, "1536x17920": 4, "1536x151936": 9, "8960x1536": 16, "1536x1536": None}
setups = {"fbgemm": {}, "before": before, "now": {s: c[1] for s, c in now.items() if c}}


def rss_gib() -> float:
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmRSS"))
    return int(line.split()[1]) / 2**20


def use(choice):
    for product in products(model):
        rows = choice.get(f"{product.shape[0]}x{product.shape[1]}")
        product.run_wide_from(rows, VNNI) if rows else product.run_wide_from(None)


prompt = [(1000 + (i * 37) % 5000) % vocab for i in range(500)]
times = {name: {w: [] for w in ("prefill", *widths)} for name in setups}
memory = {}
with torch.inference_mode():
    for r in range(rounds + 1):
        for name, choice in (list(setups.items()) if r % 2 else list(reversed(setups.items()))):
            use(choice)
            memory[name] = rss_gib()
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
print("median over", rounds, "rounds (prefill: s, 500 tokens; T(n): ms); RSS after the switch (GiB)")
for name in setups:
    print(f"{name:7s}", " ".join(
        f"{w if w == 'prefill' else f'T({w})'}={statistics.median(v) * (1 if w == 'prefill' else 1e3):.3f}"
        for w, v in times[name].items()), f"RSS={memory[name]:.2f}")
print("peak RSS (GiB):", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20)

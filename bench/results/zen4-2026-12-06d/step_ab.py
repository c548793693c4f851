"""A decode step (1 row after a 500-token prompt) under fbgemm only against the engine's measured
choice, the setups alternated step by step in one process (many steps: this host's noise is ±10 %
from minute to minute). Run from the repo root:

    SPECDEC_INT8_KERNELS=fbgemm PYTHONPATH=. python bench/results/zen4-2026-12-06d/step_ab.py [steps]
"""
import statistics
import sys
import time

import torch

from bench.bench_grounded import load_hf_target
from specdec.defaults import DEFAULT_TARGET_MODEL, specdec_home
from specdec.models import resolve_model
from specdec.runtime.int8_kernels import CACHE_FILE, choose_kernels
from specdec.runtime.kv import TreeKVCache

steps = int(sys.argv[1]) if len(sys.argv) > 1 else 40
loaded = load_hf_target(resolve_model(DEFAULT_TARGET_MODEL), "int8", 2)
model, vocab = loaded.model, loaded.info.vocab_size
prompt = [(1000 + (i * 37) % 5000) % vocab for i in range(500)]
times: dict[str, list[float]] = {"fbgemm": [], "chosen": []}
with torch.inference_mode():
    kv = TreeKVCache(model)
    kv.prefill(prompt)
    for step in range(steps + 2):
        for name in (times if step % 2 else reversed(times)):
            choose_kernels(model, specdec_home() / CACHE_FILE, mode="auto" if name == "chosen" else "fbgemm")
            began = time.perf_counter()
            kv.extend_chain([(500 + step) % vocab])
            if step >= 2:
                times[name].append(time.perf_counter() - began)
            kv.settle([])
print({name: f"median {statistics.median(t) * 1e3:.1f} ms, min {min(t) * 1e3:.1f} ms ({len(t)} steps)"
       for name, t in times.items()})

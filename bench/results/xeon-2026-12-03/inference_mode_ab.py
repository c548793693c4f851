"""One pass under no_grad against inference mode, alternated in one process (issue 37, 2026-12-03).

    PYTHONPATH=. python bench/results/xeon-2026-12-03/inference_mode_ab.py     (2 min)

The default target at specdec's int8, loaded and run on a ComputeThread as an engine does, a
40-token prompt, then 30 one-token passes per round (their median, the first two left out); 8
rounds of each mode, alternated, so the host's drift falls on both.
"""

import statistics
import time

import torch

from bench.bench_grounded import load_hf_target
from specdec.defaults import DEFAULT_TARGET_MODEL
from specdec.models import resolve_model
from specdec.runtime.compute_thread import ComputeThread
from specdec.runtime.kv import TreeKVCache

compute = ComputeThread(2)
loaded = compute.call(load_hf_target, resolve_model(DEFAULT_TARGET_MODEL), "int8", 2)
vocab = loaded.info.vocab_size
prompt = [(1000 + (i * 37) % 5000) % vocab for i in range(40)]


def one_round(mode) -> float:
    with mode():
        kv = TreeKVCache(loaded.model)
        kv.prefill(prompt)
        times = []
        for t in range(30):
            began = time.perf_counter()
            kv.extend_chain([(500 + t) % vocab])
            times.append(time.perf_counter() - began)
            kv.settle([0])
        return statistics.median(times[2:])


results: dict[str, list[float]] = {"no_grad": [], "inference_mode": []}
for _ in range(8):
    for name, mode in (("no_grad", torch.no_grad), ("inference_mode", torch.inference_mode)):
        results[name].append(1e3 * compute.call(one_round, mode))
for name, values in results.items():
    rounded = [round(v, 1) for v in values]
    print(f"{name}: T(1) ms per round {rounded}, median {statistics.median(values):.1f}")

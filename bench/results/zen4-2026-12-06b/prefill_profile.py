"""Where a 427-token prompt's prefill goes: our int8 target, 512-token chunks, main thread, 2 threads;
three timed prefills, then one under torch's profiler (ops by their own time). The fixed-order
attention kernel is C called through ctypes, so the profiler does not see it: it is most of the
wall time the table does not cover.

    PYTHONPATH=. python bench/results/zen4-2026-12-06b/prefill_profile.py
"""

import time

import torch
from torch.profiler import ProfilerActivity, profile

from bench.bench_grounded import load_hf_target
from specdec.models import resolve_model
from specdec.runtime.kv import TreeKVCache

torch.set_num_threads(2)
ours = load_hf_target(resolve_model("qwen2.5-coder-1.5b"), "int8", 2)
prompt = [(1000 + (i * 37) % 5000) % ours.info.vocab_size for i in range(427)]


def prefill() -> None:
    with torch.inference_mode():
        TreeKVCache(ours.model).prefill(prompt)


for _ in range(2):
    prefill()
walls = []
for _ in range(3):
    began = time.perf_counter()
    prefill()
    walls.append(time.perf_counter() - began)
print("prefill wall, s:", [round(w, 3) for w in walls])
with profile(activities=[ProfilerActivity.CPU]) as prof:
    prefill()
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=60))

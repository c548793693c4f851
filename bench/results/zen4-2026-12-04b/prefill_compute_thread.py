"""A prompt's prefill as an engine runs it: both models loaded and run on one compute thread, every
other thread at one torch thread; alternated: plain HF's per-tensor model in one pass, ours alone
in 128- / 512-token chunks, ours through the ragged batcher in 128- / 512-token chunks; with the
minor page faults of each (the allocator's thresholds keep ours at none).

    PYTHONPATH=. python bench/results/zen4-2026-12-04b/prefill_compute_thread.py 427 6
"""

import resource
import statistics
import sys
import time

import torch

import specdec.runtime.kv as kv_module
from bench.bench_grounded import load_hf_target
from specdec.models import resolve_model
from specdec.runtime.batch_config import BatchConfig
from specdec.runtime.batching import ForwardBatcher
from specdec.runtime.compute_thread import ComputeThread


def main() -> None:
    n, rounds = int(sys.argv[1]), int(sys.argv[2])
    compute = ComputeThread(threads=2)
    torch.set_num_threads(1)
    ours = compute.call(lambda: load_hf_target(resolve_model("qwen2.5-coder-1.5b"), "int8", 2))
    hf = compute.call(lambda: load_hf_target(resolve_model("qwen2.5-coder-1.5b"), "int8-per-tensor", 2))
    batcher = ForwardBatcher(ours.model, BatchConfig(), compute=compute)
    vocab = ours.info.vocab_size
    prompt = [(1000 + (i * 37) % 5000) % vocab for i in range(n)]

    def hf_pass() -> None:
        with torch.inference_mode():
            hf.model(torch.tensor([prompt]), use_cache=True, logits_to_keep=1)

    def ours_run(ragged: bool, chunk: int) -> None:
        kv_module.PREFILL_CHUNK_CPU = chunk
        kv = kv_module.TreeKVCache(ours.model)

        def prefill() -> None:
            with torch.inference_mode():
                kv.prefill(prompt)

        if ragged:
            kv.runner = batcher
            prefill()
        else:
            compute.call(prefill)

    variants = {"hf": lambda: compute.call(hf_pass), "alone-128": lambda: ours_run(False, 128),
                "alone-512": lambda: ours_run(False, 512), "ragged-128": lambda: ours_run(True, 128),
                "ragged-512": lambda: ours_run(True, 512)}
    wall: dict[str, list[float]] = {k: [] for k in variants}
    faults: dict[str, list[int]] = {k: [] for k in variants}
    for rnd in range(rounds + 1):  # round 0 warms up
        for name, run in variants.items():
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            began = time.perf_counter()
            run()
            if rnd:
                wall[name].append(time.perf_counter() - began)
                faults[name].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    for name, values in wall.items():
        print(name, f"median {statistics.median(values):.3f} min {min(values):.3f}",
              [round(v, 2) for v in values], "minor faults", faults[name])


if __name__ == "__main__":
    main()

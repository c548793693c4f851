"""A prompt's prefill on the main thread, alternated: plain HF's per-tensor int8 model in one pass,
ours (the batch-invariant int8) in 128- and in 512-token chunks (`PREFILL_CHUNK_CPU` patched).

    PYTHONPATH=. python bench/results/zen4-2026-12-04b/prefill_main_thread.py 427 6
"""

import statistics
import sys
import time

import torch

import specdec.runtime.kv as kv_module
from bench.bench_grounded import load_hf_target
from specdec.models import resolve_model


def main() -> None:
    n, rounds = int(sys.argv[1]), int(sys.argv[2])
    torch.set_num_threads(2)
    hf = load_hf_target(resolve_model("qwen2.5-coder-1.5b"), "int8-per-tensor", 2)
    ours = load_hf_target(resolve_model("qwen2.5-coder-1.5b"), "int8", 2)
    vocab = ours.info.vocab_size
    prompt = [(1000 + (i * 37) % 5000) % vocab for i in range(n)]

    def run_hf() -> None:
        hf.model(torch.tensor([prompt]), use_cache=True, logits_to_keep=1)

    def run_ours(chunk: int) -> None:
        kv_module.PREFILL_CHUNK_CPU = chunk
        kv_module.TreeKVCache(ours.model).prefill(prompt)

    variants = {"hf": run_hf, "ours-128": lambda: run_ours(128), "ours-512": lambda: run_ours(512)}
    wall: dict[str, list[float]] = {k: [] for k in variants}
    with torch.inference_mode():
        for rnd in range(rounds + 1):  # round 0 warms up
            for name, run in variants.items():
                began = time.perf_counter()
                run()
                if rnd:
                    wall[name].append(time.perf_counter() - began)
    for name, values in wall.items():
        print(name, f"median {statistics.median(values):.3f} min {min(values):.3f}")


if __name__ == "__main__":
    main()

"""Plain HF's decode step (`generate`, torch.ao per-tensor int8) against specdec's int8 pass (one row
after the prompt, TreeKVCache), in one process, alternated 6 times; 2 threads.

    PYTHONPATH=. python bench/results/zen4-2026-12-04/hf_vs_ours.py
"""

import statistics
import time

import torch

from bench.bench_grounded import load_hf_target
from specdec.models import resolve_model
from specdec.runtime.kv import TreeKVCache
from specdec.runtime.loading import load_model

NEW = 41


def main() -> None:
    torch.set_num_threads(2)
    path = resolve_model("qwen2.5-coder-1.5b")
    hf, ours = load_hf_target(path, "int8-per-tensor", 2), load_model(path, dtype="int8", threads=2)
    tokenizer = ours.tokenizer
    prompt = tokenizer.encode("The history of the printing press begins")
    ids = torch.tensor([prompt])
    greedy = {"do_sample": False, "pad_token_id": tokenizer.eos_token_id or 0}

    def hf_step() -> float:  # (generate NEW tokens − generate 1) / (NEW − 1): a decode step
        with torch.inference_mode():
            began = time.perf_counter()
            hf.model.generate(ids, max_new_tokens=1, min_new_tokens=1, **greedy)
            prefill = time.perf_counter() - began
            began = time.perf_counter()
            hf.model.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, **greedy)
            return (time.perf_counter() - began - prefill) / (NEW - 1) * 1e3

    def our_step() -> float:
        with torch.inference_mode():
            kv = TreeKVCache(ours.model)
            kv.prefill(prompt)
            times = []
            for j in range(NEW - 1):
                began = time.perf_counter()
                kv.extend_chain([500 + j % 7])
                times.append(time.perf_counter() - began)
                kv.settle([0])
        return statistics.mean(times) * 1e3

    hf_step(), our_step()
    for round_ in range(6):
        h, o = hf_step(), our_step()
        print(f"round {round_}: HF per-tensor generate {h:.1f} ms/token, ours {o:.1f} ms/pass, "
              f"ratio {h / o:.2f}", flush=True)


if __name__ == "__main__":
    main()

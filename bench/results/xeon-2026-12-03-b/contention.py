"""A decode step's time, alone or beside a competing draft-model process (contention.txt).

    python contention.py v THREADS CORES [STEPS]   the target's 1-row steps: prints their median
    python contention.py d THREADS CORES           the draft model's steps, without end
"""

import json
import os
import statistics
import sys
import time

import torch
from transformers import DynamicCache

from specdec.models import resolve_model
from specdec.runtime.loading import load_model


def main() -> None:
    role, threads = sys.argv[1], int(sys.argv[2])
    os.sched_setaffinity(0, [int(c) for c in sys.argv[3].split(",")])
    torch.set_num_threads(threads)
    name = "qwen2.5-coder-1.5b" if role == "v" else "qwen2.5-coder-0.5b"
    model = load_model(resolve_model(name), dtype="int8", threads=threads).model
    prompt = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]])

    def steps(n: int) -> list[float]:
        cache = DynamicCache()
        times = []
        with torch.inference_mode():
            token = model(prompt, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
            for _ in range(n):
                began = time.perf_counter()
                logits = model(token, past_key_values=cache, use_cache=True).logits
                times.append(time.perf_counter() - began)
                token = logits[:, -1:].argmax(-1)
        return times

    steps(3)
    if role == "d":
        print("ready", flush=True)
        while True:
            print("d", round(1e3 * statistics.median(steps(10)), 1), flush=True)
    times = steps(int(sys.argv[4]) if len(sys.argv) > 4 else 30)
    summary = {"median_ms": round(1e3 * statistics.median(times), 1), "min_ms": round(1e3 * min(times), 1)}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()

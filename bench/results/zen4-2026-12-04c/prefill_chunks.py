"""A prompt's prefill as a served engine runs it alone (models loaded and run on one ComputeThread,
through the ragged batcher), at several chunk sizes, alternated in one process with plain HF's
per-tensor int8 model in one pass on the same thread.

    PYTHONPATH=. python bench/results/zen4-2026-12-04c/prefill_chunks.py 427 6 128,256,512
"""

import statistics
import sys
import time

import torch
from served_engine import served_engine

import specdec.runtime.kv as kv_module


def main() -> None:
    n, rounds, chunks = int(sys.argv[1]), int(sys.argv[2]), [int(c) for c in sys.argv[3].split(",")]
    compute, ours, hf, batcher = served_engine()
    vocab = ours.info.vocab_size
    prompt = [(1000 + (i * 37) % 5000) % vocab for i in range(n)]
    print("chunk at the default:", kv_module.prefill_chunk("cpu", ours.model),
          "wide kernel:", getattr(ours.model, "specdec_int8_wide_kernel", None),
          "from rows:", getattr(ours.model, "specdec_int8_wide_rows", None), flush=True)

    def hf_pass() -> None:
        with torch.inference_mode():
            hf.model(torch.tensor([prompt]), use_cache=True, logits_to_keep=1)

    def ours_prefill(chunk: int) -> None:
        kv_module.PREFILL_CHUNK_CPU = chunk
        assert kv_module.prefill_chunk("cpu", ours.model) == chunk
        kv = kv_module.TreeKVCache(ours.model)
        kv.runner = batcher
        with torch.inference_mode():
            kv.prefill(prompt)
        assert kv.prefix_len == n

    variants = {"hf": lambda: compute.call(hf_pass)}
    variants |= {f"ours-{c}": (lambda c=c: ours_prefill(c)) for c in chunks}
    wall: dict[str, list[float]] = {k: [] for k in variants}
    for rnd in range(rounds + 1):  # round 0 warms up
        names = list(variants) if rnd % 2 else list(reversed(variants))
        for name in names:
            began = time.perf_counter()
            variants[name]()
            if rnd:
                wall[name].append(time.perf_counter() - began)
    hf_times = wall["hf"]
    for name, values in wall.items():
        ratio = statistics.median(h / v for h, v in zip(hf_times, values, strict=True))
        print(f"{name:9s} median {statistics.median(values):.3f} min {min(values):.3f}  "
              f"hf/this per round {ratio:.3f}", [round(v, 3) for v in values])


if __name__ == "__main__":
    main()

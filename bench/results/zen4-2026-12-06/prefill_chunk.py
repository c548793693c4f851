"""A prompt's prefill in 128- against 512-token chunks, on the main thread and as a served engine runs
it alone (one ComputeThread, the ragged batcher), alternated round by round in one process with our
int8 model's own forward in one pass (what plain HF's `generate` over the same model runs). Each
round also checks that both chunk sizes leave the next row bitwise the same.

    PYTHONPATH=. python bench/results/zen4-2026-12-06/prefill_chunk.py 427 6
"""

import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import DynamicCache

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "zen4-2026-12-04c"))
from served_engine import served_engine  # noqa: E402

import specdec.runtime.kv as kv_module  # noqa: E402


def main() -> None:
    n, rounds = int(sys.argv[1]), int(sys.argv[2])
    compute, ours, _, batcher = served_engine()
    vocab = ours.info.vocab_size
    prompt = [(1000 + (i * 37) % 5000) % vocab for i in range(n)]
    rows: dict[str, torch.Tensor] = {}

    def one_pass() -> None:
        with torch.inference_mode():
            ours.model(torch.tensor([prompt]), past_key_values=DynamicCache(), use_cache=True,
                       logits_to_keep=1)

    def chunked(chunk: int, served: bool) -> None:
        kv_module.PREFILL_CHUNK = chunk
        kv = kv_module.TreeKVCache(ours.model)
        if served:
            kv.runner = batcher
        with torch.inference_mode():
            kv.prefill(prompt)
        if served:  # the next row, for the bitwise check (the timing includes it for both sizes)
            rows[f"{chunk}"] = kv.extend_chain([5]).clone()
        assert kv.prefix_len == n

    variants = {
        "main one-pass": one_pass,
        "main 128": lambda: chunked(128, False),
        "main 512": lambda: chunked(512, False),
        "served one-pass": lambda: compute.call(one_pass),
        "served 128": lambda: compute.call(lambda: chunked(128, True)),
        "served 512": lambda: compute.call(lambda: chunked(512, True)),
    }
    wall: dict[str, list[float]] = {k: [] for k in variants}
    for rnd in range(rounds + 1):  # round 0 warms up
        for name in (list(variants) if rnd % 2 else list(reversed(variants))):
            began = time.perf_counter()
            variants[name]()
            if rnd:
                wall[name].append(time.perf_counter() - began)
        assert torch.equal(rows["128"], rows["512"]), "the chunk moved a row"
    print(f"{n}-token prefill, {rounds} rounds, seconds (median, min; per-round ratio to the one pass "
          "on the same thread); the next row bitwise equal at 128 and 512 in every round")
    for name, values in wall.items():
        base = wall[name.split()[0] + " one-pass"]
        ratio = statistics.median(v / b for v, b in zip(values, base, strict=True))
        print(f"{name:16s} median {statistics.median(values):.3f} min {min(values):.3f}  "
              f"÷ one pass {ratio:.3f}", [round(v, 3) for v in values])
    for where in ("main", "served"):
        pairs = zip(wall[f"{where} 128"], wall[f"{where} 512"], strict=True)
        ratio = statistics.median(a / b for a, b in pairs)
        print(f"{where}: 128-token chunks ÷ 512-token chunks per round {ratio:.3f}")


if __name__ == "__main__":
    main()

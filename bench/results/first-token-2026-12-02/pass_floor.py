"""The chat goal's floor in one process: the default target's pass for a cached turn (restore the
cached prefix from the prefix store, then the uncached rows) against a cold pass of the new tokens
alone, at the benchmark chat's shapes (cached, uncached rows, new tokens): what the served ratio
would be without the host's noise and the doors. Alternated, medians of 6 after a warm-up, 2 threads.
Run from the repo root (about a minute):

    PYTHONPATH=. python bench/results/first-token-2026-12-02/pass_floor.py
"""

from __future__ import annotations

import statistics
import time

import torch

from bench.bench_grounded import load_hf_target
from bench.machine import cpu_model
from specdec.defaults import DEFAULT_TARGET_MODEL
from specdec.models import resolve_model
from specdec.runtime.kv import TreeKVCache
from specdec.runtime.prefix_cache import PrefixLink, PrefixStore

SHAPES = ((163, 33, 31), (291, 23, 20), (410, 29, 27), (535, 29, 27))  # turns 2-5 of bench_prefix's chat


def main() -> None:
    loaded = load_hf_target(resolve_model(DEFAULT_TARGET_MODEL), "int8", 2)
    vocab = loaded.info.vocab_size

    def tokens(n: int, salt: int) -> list[int]:
        return [(1000 + (i * 37 + salt) % 5000) % vocab for i in range(n)]

    store = PrefixStore(2 << 30)
    times: dict[tuple[int, str], list[float]] = {}
    with torch.inference_mode():
        for cached, _, _ in SHAPES:  # the earlier turns, stored as a finished session leaves them
            kv = TreeKVCache(loaded.model)
            kv.prefix_link = PrefixLink(store, "chat")
            kv.prefill(tokens(cached, 0))
            kv.publish_tail()
        for repeat in range(7):
            for cached, uncached, new in SHAPES:
                prompt = tokens(cached, 0) + tokens(uncached, 99)
                kv = TreeKVCache(loaded.model)
                kv.prefix_link = PrefixLink(store, "chat")
                began = time.perf_counter()
                restored = kv.restore_prefix(prompt)
                kv.extend_chain(prompt[restored:])
                hit = time.perf_counter() - began
                assert restored == cached, (restored, cached)
                began = time.perf_counter()
                TreeKVCache(loaded.model).prefill(tokens(new, 99))
                alone = time.perf_counter() - began
                if repeat:
                    times.setdefault((cached, "hit"), []).append(hit)
                    times.setdefault((cached, "alone"), []).append(alone)
    print(f"{cpu_model()}, 2 threads, int8")
    print("| turn | cached | uncached rows | new tokens | hit pass (ms) | new alone (ms) | ratio |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for turn, (cached, uncached, new) in enumerate(SHAPES, start=2):
        hit, alone = (1e3 * statistics.median(times[(cached, kind)]) for kind in ("hit", "alone"))
        print(f"| {turn} | {cached} | {uncached} | {new} | {hit:.0f} | {alone:.0f} | {hit / alone:.2f}× |")


if __name__ == "__main__":
    main()

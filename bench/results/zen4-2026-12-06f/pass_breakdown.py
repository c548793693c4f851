"""Where a pass of the default target goes, in one process: each pass timed whole, with its int8
products timed by wrapping them (GEMMs, their quantisation included), its attention calls wrapped
likewise, and the same pass with every int8 product stubbed out (a zero product: what is left is
everything else). 400 tokens of context, 8 passes per width, medians. SPECDEC_LAYER_KERNELS=0 for
transformers' norms and MLP middles. Run from the repo root:

    PYTHONPATH=. python bench/results/zen4-2026-12-06f/pass_breakdown.py 1,10,16
"""

import statistics
import sys
import time
from collections import defaultdict

import torch

from bench.bench_grounded import load_hf_target
from bench.bench_pass import prompt_ids
from specdec.defaults import DEFAULT_TARGET_MODEL
from specdec.models import resolve_model
from specdec.runtime import int8
from specdec.runtime.kv import TreeKVCache

spent: dict[str, float] = defaultdict(float)
stubbed = [False]
real_product = int8.Int8Product.all_columns
real_attention = int8.fixed_order_attention


def product(self, x):
    rows = x.reshape(-1, x.shape[-1]).shape[0]
    if stubbed[0]:
        return torch.zeros(rows, self.shape[1]), torch.ones(rows, 1)
    began = time.perf_counter()
    result = real_product(self, x)
    spent["int8 products"] += time.perf_counter() - began
    return result


def attention(*args, **kwargs):
    began = time.perf_counter()
    result = real_attention(*args, **kwargs)
    spent["attention"] += time.perf_counter() - began
    return result


def main(widths: list[int]) -> None:
    int8.Int8Product.all_columns = product
    int8.fixed_order_attention = attention
    loaded = load_hf_target(resolve_model(DEFAULT_TARGET_MODEL), "int8", 2)
    vocab = loaded.info.vocab_size
    with torch.inference_mode():
        kv = TreeKVCache(loaded.model)
        kv.prefill(prompt_ids(vocab, 400))
        for n in widths:
            tokens, parents = [t % vocab for t in range(600, 600 + n)], list(range(-1, n - 1))
            walls: dict[bool, list[float]] = {False: [], True: []}
            parts: list[dict[str, float]] = []
            for _ in range(8):
                for stub in (False, True):
                    stubbed[0] = stub
                    spent.clear()
                    began = time.perf_counter()
                    kv.extend(tokens, parents)
                    kv.settle([])
                    walls[stub].append(time.perf_counter() - began)
                    if not stub:
                        parts.append(dict(spent))
            shares = {name: statistics.median(p.get(name, 0.0) for p in parts)
                      for name in ("int8 products", "attention")}
            print(f"T({n}) {1e3 * statistics.median(walls[False]):.1f} ms: "
                  + ", ".join(f"{name} {1e3 * value:.1f}" for name, value in shares.items())
                  + f"; with the products stubbed out {1e3 * statistics.median(walls[True]):.1f} ms")


if __name__ == "__main__":
    main([int(w) for w in sys.argv[1].split(",")])

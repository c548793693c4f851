"""transformers' forward against a lean one over the same modules (embedding, per layer the norms,
projections, rotary, cache update, attention function and MLP, the final norm and the vocabulary
rows), no decorators, mask builders or output classes: bitwise the same logits, and what the
wrappers cost. One process, the two alternated, 8 rounds, after a 400-token prompt. The lean pass
this script first carried became specdec.runtime.lean_forward (the engines' pass since
bench/results/zen4-2026-12-06g/); the script now switches that module. Run from the repo root:

    PYTHONPATH=. python bench/results/zen4-2026-12-06f/lean_forward.py
"""

import os
import statistics
import time

import torch

from bench.bench_grounded import load_hf_target
from bench.bench_pass import prompt_ids
from specdec.defaults import DEFAULT_TARGET_MODEL
from specdec.models import resolve_model
from specdec.runtime import lean_forward
from specdec.runtime.kv import TreeKVCache


def use_lean(lean: bool) -> None:
    os.environ[lean_forward.ENV] = "1" if lean else "0"


def main() -> None:
    loaded = load_hf_target(resolve_model(DEFAULT_TARGET_MODEL), "int8", 2)
    vocab = loaded.info.vocab_size
    with torch.inference_mode():
        kv = TreeKVCache(loaded.model)
        kv.prefill(prompt_ids(vocab, 400))
        for n in (1, 4, 10):
            tokens, parents = [t % vocab for t in range(600, 600 + n)], list(range(-1, n - 1))
            rows = {}
            for lean in (False, True):
                use_lean(lean)
                rows[lean] = kv.extend(tokens, parents)
                kv.settle([])
            times: dict[bool, list[float]] = {False: [], True: []}
            for _ in range(8):
                for lean in (False, True):
                    use_lean(lean)
                    began = time.perf_counter()
                    kv.extend(tokens, parents)
                    kv.settle([])
                    times[lean].append(time.perf_counter() - began)
            plain, lean_ = (1e3 * statistics.median(times[key]) for key in (False, True))
            print(f"T({n}): bitwise equal {torch.equal(rows[False], rows[True])}; transformers' forward "
                  f"{plain:.1f} ms, lean {lean_:.1f} ms")


if __name__ == "__main__":
    main()

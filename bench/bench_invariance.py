"""Pass-composition dependence and pass time of the target, per precision, side by side.

For one code context, the next-token row of its last position is computed alone (one token per
pass) and inside other passes: a verify pass over the last s tokens, a tree pass with side
branches, a batched pass beside two other sessions. Reported per precision: whether each row is
bitwise the lone one, max |Δlogit| and total variation. Then the pass time T(n) at two context
lengths, precisions interleaved repeat by repeat (medians), so a noisy machine hits all alike.

    python -m bench.bench_invariance                       # default target, 2 threads
    python -m bench.bench_invariance --out bench/results/int8-invariant-2026-11-25/invariance.md

Precisions: float32; int8-per-tensor (torch.ao's dynamic quantisation, the former int8 default,
rebuilt here for comparison); int8 (the batch-invariant default, specdec/runtime/int8.py).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from bench.bench_grounded import PER_TENSOR, load_hf_target
from specdec.defaults import DEFAULT_TARGET_MODEL
from specdec.models import resolve_model
from specdec.runtime.batch_config import BatchConfig
from specdec.runtime.batching import ForwardBatcher, _Job
from specdec.runtime.kv import TreeKVCache
from specdec.runtime.tokenizers import load_tokenizer

CONTEXT = (
    "def quicksort(items):\n    if len(items) <= 1:\n        return items\n"
    "    pivot = items[len(items) // 2]\n    left = [x for x in items if x < pivot]\n"
)
PRECISIONS = ("float32", PER_TENSOR, "int8")


def row_alone(model, ids: list[int]) -> torch.Tensor:
    kv = TreeKVCache(model)
    kv.prefill(ids[:-1])
    return kv.extend_chain(ids[-1:])[-1]


def row_in_chain(model, ids: list[int], s: int) -> torch.Tensor:
    kv = TreeKVCache(model)
    kv.prefill(ids[:-s])
    return kv.extend_chain(ids[-s:])[-1]


def row_in_tree(model, ids: list[int]) -> torch.Tensor:
    kv = TreeKVCache(model)
    kv.prefill(ids[:-2])
    logits = kv.extend([ids[-2], 11, 22, ids[-1], 33], [-1, 0, 1, 0, 3])
    return logits[3]


def row_in_batch(model, ids: list[int]) -> torch.Tensor:
    batcher = ForwardBatcher(model, BatchConfig(window_ms=0))
    jobs = []
    for context in (ids, ids[:20], ids[5:40] + ids[:7]):
        kv = TreeKVCache(model, runner=batcher)
        kv.prefill(context[:-3])
        jobs.append(_Job(kv=kv, plan=kv.plan(context[-3:], [-1, 0, 1], 0)))
    batcher._execute(jobs)
    return jobs[0].logits[-1]


def dependence(model, ids: list[int]) -> list[tuple[str, bool, float, float]]:
    reference = row_alone(model, ids)
    rows = [(f"verify pass of {s}", row_in_chain(model, ids, s)) for s in (2, 5, 9)]
    rows += [("tree pass", row_in_tree(model, ids)), ("batched pass", row_in_batch(model, ids))]
    out = []
    for name, row in rows:
        tv = 0.5 * (torch.softmax(row.double(), -1) - torch.softmax(reference.double(), -1)).abs().sum()
        out.append((name, torch.equal(row, reference), float((row - reference).abs().max()), float(tv)))
    return out


def prefilled(model, context: int) -> TreeKVCache:
    kv = TreeKVCache(model)
    kv.prefill([(i * 7919) % 30000 + 100 for i in range(context)])
    return kv


def pass_time(kv: TreeKVCache, context: int, n: int) -> float:
    """One pass over n new tokens after `context` cached ones (the cache rolled back after)."""
    kv.truncate(context)
    start = time.perf_counter()
    kv.extend_chain(list(range(500, 500 + n)), rows_from=0)
    elapsed = time.perf_counter() - start
    kv.truncate(context)
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=None, help="model directory (default: the default target)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--contexts", default="200,1500")
    parser.add_argument("--sizes", default="1,9")
    parser.add_argument("--prefill", type=int, default=500, help="also time a prompt prefill this long")
    parser.add_argument("--out", type=Path, default=None, help="write the markdown table here too")
    args = parser.parse_args()
    path = args.target or str(resolve_model(DEFAULT_TARGET_MODEL))
    models = {p: load_hf_target(path, p, args.threads).model for p in PRECISIONS}
    ids = load_tokenizer(Path(path))(CONTEXT)["input_ids"]
    lines = [f"Target {path}, {args.threads} threads, context of {len(ids)} tokens.", "",
             "| precision | pass | bitwise | max abs Δlogit | TV |", "|---|---|---|---:|---:|"]
    with torch.no_grad():
        for precision, model in models.items():
            for name, equal, delta, tv in dependence(model, ids):
                bitwise = "yes" if equal else "no"
                lines.append(f"| {precision} | {name} | {bitwise} | {delta:.3g} | {tv:.2g} |")
                print(lines[-1], flush=True)
        contexts = [int(c) for c in args.contexts.split(",")]
        sizes = [int(n) for n in args.sizes.split(",")]
        times: dict[tuple[str, int, int], list[float]] = {}
        caches = {(p, c): prefilled(models[p], c) for p in PRECISIONS[1:] for c in contexts}
        for key, kv in caches.items():  # warm
            pass_time(kv, key[1], max(sizes))
        for _ in range(args.repeats):
            for context in contexts:
                for n in sizes:
                    for precision in PRECISIONS[1:]:
                        elapsed = pass_time(caches[(precision, context)], context, n)
                        times.setdefault((precision, context, n), []).append(elapsed)
            for precision in PRECISIONS[1:]:
                start = time.perf_counter()
                prefilled(models[precision], args.prefill)
                times.setdefault((precision, 0, args.prefill), []).append(time.perf_counter() - start)
    lines += ["", f"Pass time, median of {args.repeats} (interleaved); prefill: a fresh cache's prompt.", "",
              "| context | n | int8-per-tensor T(n) | int8 T(n) | ratio |", "|---:|---:|---:|---:|---:|"]
    for context, n in [(c, n) for c in contexts for n in sizes] + [(0, args.prefill)]:
        old = statistics.median(times[("int8-per-tensor", context, n)]) * 1e3
        new = statistics.median(times[("int8", context, n)]) * 1e3
        label = f"| {context} | {n} |" if context else f"| prefill | {n} |"
        lines.append(f"{label} {old:.1f} ms | {new:.1f} ms | {new / old:.2f} |")
        print(lines[-1], flush=True)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

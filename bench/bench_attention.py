"""What the exact (float64) attention of the int8 precision costs, and what float32 would save.

Issue 37 asks for a cheaper way to the same guarantee (rows bitwise the same in every pass shape,
docs/algorithms.md §14). This measures the budget such a change competes for:

1. In the default target's passes: the time spent in the attention function against the whole
   pass, for the prompt's prefill (in chunks), a one-row pass after it (a target-only step) and a
   wider one (a chat turn's cached pass), at a few prompt lengths.
2. One layer's attention alone at the default target's shapes (12 query heads over 2 key/value
   heads, head dim 128): float64 sdpa, the grouped float64 products the int8 model runs for masked
   multi-row passes, and float32 sdpa (not pass-invariant: what the guarantee costs).

    python -m bench.bench_attention --out bench/results/attention-DATE.md      (2 min)

Medians of --repeats; 2 threads, as an engine on this machine's two cores.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

from bench.machine import cpu_model


def _median_ms(run: Callable[[], object], repeats: int) -> float:
    for _ in range(2):
        run()
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        run()
        times.append(time.perf_counter() - began)
    return 1e3 * statistics.median(times)


def in_model(target: str | None, contexts: list[int], rows: int, repeats: int, threads: int) -> list[str]:
    """Table rows: per context, the prompt's prefill, a one-row pass and a `rows`-row pass after it,
    whole and in attention."""
    import torch
    from transformers import AttentionInterface

    import specdec.runtime.int8 as int8
    from bench.bench_grounded import load_hf_target
    from specdec.defaults import DEFAULT_TARGET_MODEL
    from specdec.models import resolve_model
    from specdec.runtime.kv import TreeKVCache

    loaded = load_hf_target(resolve_model(target or DEFAULT_TARGET_MODEL), "int8", threads)
    vocab = loaded.info.vocab_size  # token ids modulo a small test vocabulary
    spent = [0.0]
    exact = int8._float64_sdpa

    def timed(*args, **kwargs):
        began = time.perf_counter()
        out = exact(*args, **kwargs)
        spent[0] += time.perf_counter() - began
        return out

    AttentionInterface.register(int8.INVARIANT_ATTENTION, timed)  # after loading, which registers its own
    lines = []
    with torch.inference_mode():
        for context in contexts:
            prompt = [(1000 + (i * 37) % 5000) % vocab for i in range(context)]
            figures: dict[str, list[tuple[float, float]]] = {"prefill": [], "one": [], "wide": []}
            for _ in range(repeats):
                kv = TreeKVCache(loaded.model)
                spent[0] = 0.0
                began = time.perf_counter()
                kv.prefill(prompt)
                figures["prefill"].append((time.perf_counter() - began, spent[0]))
                wide = [t % vocab for t in range(600, 600 + rows)]
                for name, tokens in (("one", [500 % vocab]), ("wide", wide)):
                    spent[0] = 0.0
                    began = time.perf_counter()
                    kv.extend_chain(tokens)
                    figures[name].append((time.perf_counter() - began, spent[0]))
                    kv.settle([])
            labels = {"prefill": "the prompt's prefill", "one": "1 row", "wide": f"{rows} rows"}
            for name, label in labels.items():
                whole = 1e3 * statistics.median(t for t, _ in figures[name])
                attention = 1e3 * statistics.median(a for _, a in figures[name])
                lines.append(f"| {context} | {label} | {whole:.1f} | {attention:.1f} | "
                             f"{attention / whole:.0%} |")
    return lines


def _layer_times(rows: int, context: int, repeats: int) -> tuple[float, float, float]:
    """One layer's attention over `context` keys for `rows` causal rows: float64 sdpa, grouped
    float64, float32 sdpa (ms)."""
    import torch
    import torch.nn.functional as F

    from specdec.runtime.int8 import _grouped_float64_attention

    query = torch.randn(1, 12, rows, 128)
    keys, values = torch.randn(1, 2, context, 128), torch.randn(1, 2, context, 128)
    mask = torch.zeros(1, 1, rows, context)
    mask[..., -rows:] = torch.triu(torch.full((rows, rows), float("-inf")), 1)
    q64, k64, v64, m64 = query.double(), keys.double(), values.double(), mask.double()

    def sdpa(q, k, v, m):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True)

    return (_median_ms(lambda: sdpa(q64, k64, v64, m64), repeats),
            _median_ms(lambda: _grouped_float64_attention(query, k64, v64, m64, None), repeats),
            _median_ms(lambda: sdpa(query, keys, values, mask), repeats))


def one_layer(shapes: list[tuple[int, int]], repeats: int) -> list[str]:
    """Table rows: per (rows, context), one layer's attention in float64 and float32, ms."""
    lines = []
    for rows, context in shapes:
        sdpa64, grouped64, sdpa32 = _layer_times(rows, context, repeats)
        lines.append(f"| {rows} | {context} | {sdpa64:.3f} | {grouped64:.3f} | {sdpa32:.3f} | "
                     f"{min(sdpa64, grouped64) / sdpa32:.2f}× |")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.bench_attention", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=None, help="model (default: the default target)")
    p.add_argument("--contexts", default="100,500,1000", help="prompt tokens (cached before later passes)")
    p.add_argument("--rows", type=int, default=45, help="rows of the wide pass (a chat turn's cached pass)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=None, help="also write the tables here (markdown)")
    args = p.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    contexts = [int(c) for c in args.contexts.split(",")]
    text = [f"CPU: {cpu_model()}, {args.threads} threads, medians of {args.repeats}.", "",
            "In the default target's passes at int8 (attention: the exact float64 function's time):", "",
            "| prompt | pass | whole pass ms | attention ms | share |", "|---:|---|---:|---:|---:|",
            *in_model(args.target, contexts, args.rows, args.repeats, args.threads), "",
            "One layer's attention alone (12 query heads, 2 key/value heads, dim 128), ms:", "",
            "| rows | context | float64 sdpa | float64 grouped | float32 sdpa | float64 / float32 |",
            "|---:|---:|---:|---:|---:|---:|",
            *one_layer([(1, c) for c in contexts] + [(args.rows, c) for c in contexts], args.repeats * 6)]
    print("\n".join(text))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(f"`python -m bench.bench_attention {' '.join(argv or sys.argv[1:])}`\n\n"
                            + "\n".join(text) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

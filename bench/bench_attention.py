"""What the int8 precision's exact attention costs: float64 against the fixed-order kernel.

Rows must be bitwise the same in every pass shape (docs/algorithms.md §14); two attentions give
that, the float64 one and the fixed-order float32 kernel (specdec.runtime.fixed_attention). This
measures both:

1. In the default target's passes (the target loaded once with each): the whole pass and the time
   in the attention function, for the prompt's prefill (in chunks), a one-row pass after it (a
   target-only step) and a wider one (a chat turn's cached pass), at a few prompt lengths.
2. One layer's attention alone at the default target's shapes (12 query heads over 2 key/value
   heads, head dim 128): float64 sdpa, the grouped float64 products the int8 model runs for masked
   multi-row passes, the fixed-order kernel, and float32 sdpa (not pass-invariant: a floor).

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


def _load(target: str | None, attention: str, threads: int):
    """The default target at int8 with `attention` (fixed_attention's names) as its invariant attention."""
    import os

    from bench.bench_grounded import load_hf_target
    from specdec.defaults import DEFAULT_TARGET_MODEL
    from specdec.models import resolve_model
    from specdec.runtime.fixed_attention import ATTENTION_ENV

    previous = os.environ.get(ATTENTION_ENV)
    os.environ[ATTENTION_ENV] = attention
    try:
        return load_hf_target(resolve_model(target or DEFAULT_TARGET_MODEL), "int8", threads)
    finally:
        if previous is None:
            os.environ.pop(ATTENTION_ENV)
        else:
            os.environ[ATTENTION_ENV] = previous


def in_model(target: str | None, contexts: list[int], rows: int, repeats: int, threads: int) -> list[str]:
    """Table rows: per context, the prompt's prefill, a one-row pass and a `rows`-row pass after it,
    whole and in attention, with each invariant attention (the two models' passes alternate)."""
    import torch
    from transformers import AttentionInterface

    import specdec.runtime.int8 as int8
    from specdec.runtime.fixed_attention import FIXED_ORDER, FLOAT64
    from specdec.runtime.kv import TreeKVCache

    spent = [0.0]

    def timing(function):
        def timed(*args, **kwargs):
            began = time.perf_counter()
            out = function(*args, **kwargs)
            spent[0] += time.perf_counter() - began
            return out
        return timed

    models = {attention: _load(target, attention, threads).model for attention in (FLOAT64, FIXED_ORDER)}
    # after loading, which registers the plain functions
    AttentionInterface.register(int8.INVARIANT_ATTENTION, timing(int8._float64_sdpa))
    AttentionInterface.register(int8.FIXED_ORDER_ATTENTION, timing(int8._fixed_order_sdpa))
    vocab = models[FLOAT64].config.vocab_size  # token ids modulo a small test vocabulary
    lines = []
    with torch.inference_mode():
        for context in contexts:
            prompt = [(1000 + (i * 37) % 5000) % vocab for i in range(context)]
            figures = {(attention, name): [] for attention in models for name in ("prefill", "one", "wide")}
            for _ in range(repeats):
                for attention, model in models.items():
                    kv = TreeKVCache(model)
                    spent[0] = 0.0
                    began = time.perf_counter()
                    kv.prefill(prompt)
                    figures[attention, "prefill"].append((time.perf_counter() - began, spent[0]))
                    wide = [t % vocab for t in range(600, 600 + rows)]
                    for name, tokens in (("one", [500 % vocab]), ("wide", wide)):
                        spent[0] = 0.0
                        began = time.perf_counter()
                        kv.extend_chain(tokens)
                        figures[attention, name].append((time.perf_counter() - began, spent[0]))
                        kv.settle([])
            labels = {"prefill": "the prompt's prefill", "one": "1 row", "wide": f"{rows} rows"}
            for name, label in labels.items():
                cells, wholes = [], []
                for attention in models:
                    whole = 1e3 * statistics.median(t for t, _ in figures[attention, name])
                    part = 1e3 * statistics.median(a for _, a in figures[attention, name])
                    cells.append(f"{whole:.1f} | {part:.1f} ({part / whole:.0%})")
                    wholes.append(whole)
                lines.append(f"| {context} | {label} | {' | '.join(cells)} | {wholes[0] / wholes[1]:.2f}× |")
    return lines


def _layer_times(rows: int, context: int, repeats: int) -> tuple[float, float, float, float]:
    """One layer's attention over `context` keys for `rows` causal rows: float64 sdpa, grouped
    float64, the fixed-order kernel, float32 sdpa (ms)."""
    import torch
    import torch.nn.functional as F

    from specdec.runtime.fixed_attention import fixed_order_attention
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
            _median_ms(lambda: fixed_order_attention(query, keys, values, mask), repeats),
            _median_ms(lambda: sdpa(query, keys, values, mask), repeats))


def one_layer(shapes: list[tuple[int, int]], repeats: int) -> list[str]:
    """Table rows: per (rows, context), one layer's attention each way, ms."""
    lines = []
    for rows, context in shapes:
        sdpa64, grouped64, fixed, sdpa32 = _layer_times(rows, context, repeats)
        lines.append(f"| {rows} | {context} | {sdpa64:.3f} | {grouped64:.3f} | {fixed:.3f} | {sdpa32:.3f} | "
                     f"{min(sdpa64, grouped64) / fixed:.2f}× |")
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
            "In the default target's passes at int8, with each invariant attention (ms; the "
            "attention function's time and share in brackets):", "",
            "| prompt | pass | float64: whole | attention | fixed-order: whole | attention | "
            "float64 ÷ fixed-order |", "|---:|---|---:|---:|---:|---:|---:|",
            *in_model(args.target, contexts, args.rows, args.repeats, args.threads), "",
            "One layer's attention alone (12 query heads, 2 key/value heads, dim 128), ms:", "",
            "| rows | context | float64 sdpa | float64 grouped | fixed-order | float32 sdpa (not invariant) "
            "| float64 ÷ fixed-order |", "|---:|---:|---:|---:|---:|---:|---:|",
            *one_layer([(1, c) for c in contexts] + [(args.rows, c) for c in contexts], args.repeats * 6)]
    print("\n".join(text))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(f"`python -m bench.bench_attention {' '.join(argv or sys.argv[1:])}`\n\n"
                            + "\n".join(text) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

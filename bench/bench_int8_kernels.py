"""Each int8 kernel's time for every distinct weight shape of a target, by rows, on this CPU.

What specdec.runtime.int8_kernels measures at an engine's first start, printed as a table with the
choice it makes, so a CPU's figures can be recorded beside the others:

    python -m bench.bench_int8_kernels --out bench/results/<run>/int8-kernels.md    (1-2 min)

Calls are timed as an engine times them: over a pool of a shape's weights in turn (as a pass reads
them), a wide kernel stopped where it loses, and one found to be a fallback loop on the smallest
shape not timed on the others.

`--exhaustive` fills the cells an engine leaves out.

Every kernel gives bitwise the same rows (tests/runtime/test_int8_kernels.py); only time differs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _ms(seconds: float) -> str:
    """Milliseconds to three significant figures: a tiny model's call takes a few microseconds."""
    ms = 1e3 * seconds
    return f"{ms:.3g}" if ms < 100 else f"{ms:.0f}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.bench_int8_kernels", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=None, help="model (default: the default target)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", default="1,4,9,16,64,128,256", help="comma-separated row counts")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--exhaustive", action="store_true",
                   help="time every kernel at every row count (an engine stops a wide kernel where it "
                        "loses; on a CPU where a wide kernel is a fallback loop this takes ~10 min)")
    p.add_argument("--out", type=Path, default=None, help="also write the table to this file")
    args = p.parse_args(argv)

    import torch

    from bench.bench_grounded import load_hf_target
    from bench.machine import cpu_model
    from specdec.defaults import DEFAULT_TARGET_MODEL
    from specdec.models import resolve_model
    from specdec.runtime.int8_kernels import best_wide, fallback_loop, measure, products, wide_kernels

    rows = [int(r) for r in args.rows.split(",") if r.strip()]
    loaded = load_hf_target(resolve_model(args.target or DEFAULT_TARGET_MODEL), "int8", args.threads)
    shapes: dict[tuple[int, int], list] = {}
    for product in products(loaded.model):  # a shape's products: its calls are timed over a pool of them
        shapes.setdefault(product.shape, []).append(product)
    kernels = ("fbgemm", *wide_kernels())
    lines = [f"int8 kernels, fastest call's ms ({cpu_model()}, {torch.get_num_threads()} threads, "
             f"torch {torch.__version__}); {' / '.join(kernels)} (–: not timed, as an engine stops a wide "
             f"kernel where it loses); the choice as an engine makes it",
             "", "| K × N | " + " | ".join(f"{r} rows" for r in rows) + " | choice |",
             "|---|" + "---:|" * len(rows) + "---|"]
    left = list(wide_kernels())  # as an engine does: a fallback loop found once is not timed again
    for (inputs, outputs), group in sorted(shapes.items(), key=lambda item: item[0][0] * item[0][1]):
        print(f"measuring {inputs} × {outputs} …", file=sys.stderr, flush=True)
        timings = measure(group, rows_grid=rows, repeats=args.repeats, exhaustive=args.exhaustive,
                          kernels=None if args.exhaustive else left)
        left = [kernel for kernel in left if not fallback_loop(timings, kernel)]
        cells = [" / ".join(_ms(timings[r][k]) if k in timings[r] else "–" for k in kernels)
                 if r in timings else "–" for r in rows]
        choice = best_wide(timings)
        chosen = "fbgemm only" if choice is None else f"{choice[0]} from {choice[1]} rows"
        lines.append(f"| {inputs} × {outputs} | " + " | ".join(cells) + f" | {chosen} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""One target's pass times in this checkout: prefill of a prompt, T(1) and T(9) after it.

Run it from two checkouts in turn (before and after a change) to compare them on one machine:

    python -m bench.bench_pass --json             # this checkout, the default target
    for i in 1 2; do (cd ../before && python -m bench.bench_pass --json); \
        python -m bench.bench_pass --json; done

Each figure is the median of --repeats passes in one process (2 threads by default). The prompt is
a fixed code-like token sequence of --prompt-tokens tokens, so both checkouts run the same passes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.bench_pass", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=None, help="model (default: the default target)")
    p.add_argument("--prompt-tokens", type=int, default=500)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--precision", default="int8", choices=("int8", "int8-per-tensor", "float32"),
                   help="int8: specdec's batch-invariant int8; int8-per-tensor: torch.ao's dynamic int8, "
                        "plain HF's fastest on a CPU (the peer's pass)")
    p.add_argument("--widths", default="1,9",
                   help="comma-separated pass widths n to time after the prompt, T(n): a chain of n "
                        "tokens (1: a decode step; more: a draft's verify pass)")
    p.add_argument("--json", action="store_true", help="one JSON line instead of text")
    args = p.parse_args(argv)

    import torch

    from bench.bench_grounded import load_hf_target
    from specdec.defaults import DEFAULT_TARGET_MODEL
    from specdec.models import resolve_model
    from specdec.runtime.kv import TreeKVCache

    loaded = load_hf_target(resolve_model(args.target or DEFAULT_TARGET_MODEL), args.precision, args.threads)
    prompt = prompt_ids(loaded.info.vocab_size, args.prompt_tokens)
    vocab = loaded.info.vocab_size
    widths = sorted({int(w) for w in args.widths.split(",") if w.strip()} | {1})
    prefill: list[float] = []
    by_width: dict[int, list[float]] = {n: [] for n in widths}
    with torch.inference_mode():
        for repeat in range(args.repeats + 1):
            kv = TreeKVCache(loaded.model)
            began = time.perf_counter()
            kv.prefill(prompt)
            prefill.append(time.perf_counter() - began)
            for token in range(3):
                began = time.perf_counter()
                kv.extend_chain([(500 + token) % vocab])
                by_width[1].append(time.perf_counter() - began)
                kv.settle([0])
            for n in widths[1:]:
                began = time.perf_counter()
                kv.extend([t % vocab for t in range(600, 600 + n)], list(range(-1, n - 1)))
                by_width[n].append(time.perf_counter() - began)
                kv.settle([])  # the draft rejected: the next width runs on the same context
            if repeat == 0:  # warm-up
                prefill = []
                by_width = {n: [] for n in widths}
    result = {"prefill_s": statistics.median(prefill), "prompt_tokens": args.prompt_tokens,
              "precision": args.precision,
              "kernels": os.environ.get("SPECDEC_INT8_KERNELS", "auto"),
              **{f"t{n}_ms": 1e3 * statistics.median(times) for n, times in by_width.items()}}
    if args.json:
        print(json.dumps(result))
    else:
        passes = "; ".join(f"T({n}) {result[f't{n}_ms']:.1f} ms" for n in widths)
        print(f"prefill of {args.prompt_tokens} tokens {result['prefill_s']:.3f} s; {passes} "
              "(after the prompt)")
    return 0


def prompt_ids(vocab: int, tokens: int) -> list[int]:
    """The fixed code-like prompt: the same ids in every checkout (modulo a small test vocabulary)."""
    return [(1000 + (i * 37) % 5000) % vocab for i in range(tokens)]


def alternated_passes(model, vocab: int, names: Sequence[str], switch: Callable[[str], None],
                      rounds: int, widths: Sequence[int], prompt_tokens: int = 500,
                      ) -> dict[str, dict[str | int, list[float]]]:
    """Seconds of a prefill of `prompt_tokens` ("prefill") and of passes of each width (3 a round,
    each a chain rejected whole) per named setup, `switch(name)` before its turn. The setups take
    turns round by round, in reverse order every other round, so the host's drift lands on each;
    round 0 warms up and is not kept. For A/B scripts of the bench results."""
    import torch

    from specdec.runtime.kv import TreeKVCache

    prompt = prompt_ids(vocab, prompt_tokens)
    times: dict[str, dict[str | int, list[float]]] = {
        name: {width: [] for width in ("prefill", *widths)} for name in names}
    with torch.inference_mode():
        for round_ in range(rounds + 1):
            for name in (list(names) if round_ % 2 else list(reversed(names))):
                switch(name)
                kv = TreeKVCache(model)
                began = time.perf_counter()
                kv.prefill(prompt)
                if round_:
                    times[name]["prefill"].append(time.perf_counter() - began)
                for n in widths:
                    for _ in range(3):
                        began = time.perf_counter()
                        kv.extend([t % vocab for t in range(600, 600 + n)], list(range(-1, n - 1)))
                        if round_:
                            times[name][n].append(time.perf_counter() - began)
                        kv.settle([])
    return times


def swapped_in_one_process(model, vocab: int, names: tuple[str, str], switch: Callable[[str], None],
                           rounds: int, widths: Sequence[int], passes: int = 8,
                           ) -> dict[tuple[str, int], list[float]]:
    """Per (setup, width), the median of `passes` passes a round, after one 500-token prompt kept
    for every round; the two setups take turns, the order alternating, `switch(name)` before each
    turn. For A/B scripts of the bench results where both setups live in one process (their
    processes would differ by more than the setups: bench/RESULTS.md, the memory modes)."""
    import torch

    from specdec.runtime.kv import TreeKVCache

    times: dict[tuple[str, int], list[float]] = {(name, n): [] for name in names for n in widths}
    with torch.inference_mode():
        kv = TreeKVCache(model)
        kv.prefill(prompt_ids(vocab, 500))
        for round_ in range(rounds):
            for name in names if round_ % 2 == 0 else tuple(reversed(names)):
                switch(name)
                for n in widths:
                    tokens, parents = [t % vocab for t in range(600, 600 + n)], list(range(-1, n - 1))
                    seconds = []
                    for _ in range(passes):
                        began = time.perf_counter()
                        kv.extend(tokens, parents)
                        kv.settle([])
                        seconds.append(time.perf_counter() - began)
                    times[(name, n)].append(statistics.median(seconds))
    return times


def swap_report(times: dict[tuple[str, int], list[float]], names: tuple[str, str], labels: tuple[str, str],
                widths: Sequence[int]) -> list[str]:
    """One line per width: each setup's median over the rounds and the per-round ratio second/first."""
    lines = []
    for n in widths:
        first, second = times[(names[0], n)], times[(names[1], n)]
        ratios = ", ".join(f"{b / a:.2f}" for a, b in zip(first, second, strict=True))
        lines.append(f"T({n}): {labels[0]} {1e3 * statistics.median(first):.1f} ms, {labels[1]} "
                     f"{1e3 * statistics.median(second):.1f} ms; per round {names[1]}/{names[0]}: {ratios}")
    return lines


def median_line(name: str, times: dict[str | int, list[float]]) -> str:
    """One setup's medians: the prefill in seconds, T(n) in ms."""
    return f"{name:7s} " + " ".join(
        f"{w if w == 'prefill' else f'T({w})'}={statistics.median(v) * (1 if w == 'prefill' else 1e3):.3f}"
        for w, v in times.items())


if __name__ == "__main__":
    sys.exit(main())

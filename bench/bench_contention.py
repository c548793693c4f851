"""One-token pass time of each model alone on its core, and while the other model runs on the other.

    python -m bench.bench_contention --dtype int8 --seconds 20

`specdec up` pins the drafter and the verifier to cores of their own, so neither waits for the
other's CPU; but they share the memory bus and the last-level cache, and int8 passes at batch 1
mostly stream weights. On a pipelined iteration the drafter's look-ahead (two passes at k = 1) runs
beside the verifier's pass, so its passes cost what they cost *beside* it, not alone. Each model
runs in its own process pinned to its core (the drafter on the first, the target on the second),
repeats a one-token pass on a cache holding `--context` tokens (cropped back after each pass), and
reports the median; first each alone, then both at once. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import time
from typing import Any

from bench.machine import cpu_model
from specdec.defaults import DEFAULT_DRAFT_MODEL, DEFAULT_TARGET_MODEL

ROLES = ("draft", "target")


def _passes(model_dir: str, dtype: str, core: int | None, context: int, seconds: float,
            ready: Any, go: Any, out: Any) -> None:
    """Worker: load, prefill, wait for `go`, then time one-token passes for `seconds`."""
    import torch
    from transformers import DynamicCache

    from specdec.runtime.loading import load_model

    if core is not None:
        os.sched_setaffinity(0, {core})
    model = load_model(model_dir, dtype=dtype, threads=1).model
    vocab = model.config.vocab_size
    with torch.inference_mode():
        cache = DynamicCache()
        model(torch.arange(context).remainder(vocab).unsqueeze(0), past_key_values=cache, use_cache=True)
        token = torch.tensor([[context % vocab]])
        model(token, past_key_values=cache, use_cache=True)  # warm-up
        cache.crop(-1)
        ready.set()
        go.wait()
        times: list[float] = []
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            began = time.perf_counter()
            model(token, past_key_values=cache, use_cache=True)
            times.append(time.perf_counter() - began)
            cache.crop(-1)
    out.put(times)


def measure(dirs: dict[str, str], dtype: str, context: int, seconds: float,
            together: bool) -> dict[str, list[float]]:
    """Pass times per role: each alone (together=False, one after the other) or both at once."""
    ctx = multiprocessing.get_context("spawn")
    cores = sorted(os.sched_getaffinity(0))
    core_of = {role: cores[i] if len(cores) > 1 else None for i, role in enumerate(ROLES)}
    groups = [list(ROLES)] if together else [[role] for role in ROLES]
    results: dict[str, list[float]] = {}
    for group in groups:
        go = ctx.Event()
        workers = {}
        for role in group:
            ready, out = ctx.Event(), ctx.Queue()
            proc = ctx.Process(target=_passes, args=(dirs[role], dtype, core_of[role], context, seconds,
                                                     ready, go, out))
            proc.start()
            workers[role] = (proc, ready, out)
        for role, (_, ready, _) in workers.items():
            if not ready.wait(timeout=900):
                raise SystemExit(f"{role} model did not load within 900 s")
        go.set()
        for role, (proc, _, out) in workers.items():
            results[role] = out.get(timeout=seconds + 300)
            proc.join(timeout=60)
    return results


def render(alone: dict[str, list[float]], together: dict[str, list[float]], meta: dict[str, Any]) -> str:
    lines = [
        f"{meta['machine']}; {meta['draft']} (core 0) and {meta['target']} (core 1), {meta['dtype']}, "
        f"1 thread each, one-token passes on a {meta['context']}-token cache, {meta['seconds']:g} s "
        "per phase (medians).",
        f"Command: `{meta['command']}`",
        "",
        "| model | alone | beside the other | slowdown |",
        "|---|---:|---:|---:|",
    ]
    for role in ROLES:
        a, b = statistics.median(alone[role]), statistics.median(together[role])
        lines.append(f"| {meta[role]} | {a * 1000:.1f} ms ({len(alone[role])}) | "
                     f"{b * 1000:.1f} ms ({len(together[role])}) | {b / a:.2f}× |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    from specdec.models import resolve_model
    from specdec.runtime.loading import resolve_model_dir

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--draft", default=DEFAULT_DRAFT_MODEL)
    parser.add_argument("--target", default=DEFAULT_TARGET_MODEL)
    parser.add_argument("--dtype", default="int8")
    parser.add_argument("--context", type=int, default=200, help="tokens in the cache before each pass")
    parser.add_argument("--seconds", type=float, default=20.0, help="timed seconds per phase")
    args = parser.parse_args(argv)
    if args.seconds <= 0 or args.context < 1:
        parser.error("--seconds must be > 0 and --context >= 1")
    dirs = {role: str(resolve_model_dir(resolve_model(getattr(args, role)))) for role in ROLES}
    meta = {
        "machine": f"{cpu_model()}, {os.cpu_count()} CPUs",
        "draft": args.draft, "target": args.target, "dtype": args.dtype,
        "context": args.context, "seconds": args.seconds,
        "command": "python -m bench.bench_contention " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    print("each model alone …", file=sys.stderr, flush=True)
    alone = measure(dirs, args.dtype, args.context, args.seconds, together=False)
    print("both at once …", file=sys.stderr, flush=True)
    together = measure(dirs, args.dtype, args.context, args.seconds, together=True)
    print(render(alone, together, meta))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

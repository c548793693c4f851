"""Why an engine runs its model on one thread (specdec/runtime/compute_thread.py), measured.

    python -m bench.bench_threads                  # the default target, int8, the machine's cores
    python -m bench.bench_threads --tokens 64 --repeats 3 --out bench/results/threads.md

HF `generate` on the same loaded model, greedy, in three placements, each in a fresh process (an
OpenMP team, once started, stays for the life of its process):

    main            the main thread only, as plain HF runs it
    worker          a worker thread, after the model was loaded on the main thread (the main
                    thread's team exists): what the engines did before the ComputeThread
    compute-thread  a specdec ComputeThread that also loaded the model: what the engines do now

It reports ms per generated token (median of --repeats) and the process's CPU-seconds per second
(2.0 = both cores busy; near 1.0 = one core's speed).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

PLACEMENTS = ("main", "worker", "compute-thread")


def measure(placement: str, target: str, dtype: str, threads: int, tokens: int, repeats: int) -> dict:
    """One placement in this process (run by `--child`)."""
    from concurrent.futures import ThreadPoolExecutor

    import torch

    from specdec.models import resolve_model
    from specdec.runtime.compute_thread import ComputeThread
    from specdec.runtime.loading import load_model

    path = resolve_model(target)
    compute = ComputeThread(threads) if placement == "compute-thread" else None
    loaded = (compute.call(load_model, path, dtype=dtype, threads=threads) if compute
              else load_model(path, dtype=dtype, threads=threads))
    prompt = (torch.arange(100, 150) % loaded.info.vocab_size)[None]

    def generate() -> tuple[float, float]:
        with torch.inference_mode():
            began, cpu = time.perf_counter(), time.process_time()
            loaded.model.generate(prompt, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
            wall = time.perf_counter() - began
            return wall / tokens * 1000, (time.process_time() - cpu) / wall

    if placement == "main":
        run = generate
    elif placement == "worker":
        pool = ThreadPoolExecutor(1)
        run = lambda: pool.submit(generate).result()  # noqa: E731
    else:
        assert compute is not None
        run = lambda: compute.call(generate)  # noqa: E731
    run()  # warm-up
    results = [run() for _ in range(repeats)]
    return {"placement": placement, "ms_per_token": statistics.median(r[0] for r in results),
            "cpu_per_second": statistics.median(r[1] for r in results)}


def main(argv: list[str] | None = None) -> int:
    from specdec.defaults import DEFAULT_TARGET_MODEL

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=DEFAULT_TARGET_MODEL)
    p.add_argument("--dtype", default="int8")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: the machine's cores)")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=None, help="also write the table to this Markdown file")
    p.add_argument("--child", choices=PLACEMENTS, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    import os

    threads = args.threads or len(os.sched_getaffinity(0))
    if args.child:
        print(json.dumps(measure(args.child, args.target, args.dtype, threads, args.tokens, args.repeats)))
        return 0
    rows = []
    for placement in PLACEMENTS:
        print(f"{placement} …", file=sys.stderr, flush=True)
        out = subprocess.run([sys.executable, "-m", "bench.bench_threads", "--child", placement,
                              "--target", args.target, "--dtype", args.dtype, "--threads", str(threads),
                              "--tokens", str(args.tokens), "--repeats", str(args.repeats)],
                             check=True, capture_output=True, text=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
    base = rows[0]["ms_per_token"]
    lines = [f"`python -m bench.bench_threads --tokens {args.tokens} --repeats {args.repeats}` "
             f"({args.target}, {args.dtype}, {threads} torch threads)", "",
             "| placement | ms / token | × main | CPU-s / s |", "|---|---:|---:|---:|"]
    lines += [f"| {r['placement']} | {r['ms_per_token']:.1f} | {r['ms_per_token'] / base:.2f}× | "
              f"{r['cpu_per_second']:.2f} |" for r in rows]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

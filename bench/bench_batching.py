"""Time of one batched pass against its batch size: what continuous batching can gain on a machine.

    python -m bench.bench_batching --model qwen2.5-coder-1.5b --dtype int8 --threads 1 \\
        --sizes 1,2,4,8,16 --context 120,400 --new 3

For each batch size B, B sessions whose caches hold `--context` tokens (several values: the
sessions get them in turn, so the batch is ragged as in serving) extend by `--new` tokens (a
verify of a k = new - 1 draft) in one batched pass (specdec.runtime.batching), and the same B
extensions run one after another, each alone. Medians of `--repeats` (after one warm-up); the
gain is alone / batched. The batched pass is split into the model's forward and the rest (laying
the sessions' caches out in one padded batch and handing each its entries back). Prints a
markdown table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from bench.machine import cpu_model
from specdec.cli.common import resolve_model
from specdec.runtime.batch_config import BatchConfig
from specdec.runtime.batching import ForwardBatcher, _Job
from specdec.runtime.kv import TreeKVCache
from specdec.runtime.loading import load_model


class _TimedModel:
    """The model, with the time of its calls summed in `seconds` (the batched pass's forward)."""

    def __init__(self, model) -> None:
        self.model = model
        self.seconds = 0.0

    def __call__(self, *args, **kwargs):
        began = time.perf_counter()
        try:
            return self.model(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - began

    def __getattr__(self, name: str):
        return getattr(self.model, name)


def _sessions(model, batcher: ForwardBatcher, size: int, contexts: list[int]) -> list[TreeKVCache]:
    caches = []
    for i in range(size):
        kv = TreeKVCache(model, runner=batcher)
        vocab = model.config.vocab_size
        kv.prefill([(100 + i * 7 + j) % vocab for j in range(contexts[i % len(contexts)])])
        caches.append(kv)
    return caches


def _plans(caches: list[TreeKVCache], new: int) -> list[_Job]:
    tokens = [t % caches[0].model.config.vocab_size for t in range(5, 5 + new)]
    return [_Job(kv=kv, plan=kv.plan(tokens, list(range(-1, new - 1)), 0)) for kv in caches]


def _undo(jobs: list[_Job]) -> None:
    """Record the jobs' entries, then drop them again (a job that ran alone undid itself)."""
    for job in jobs:
        assert job.error is None, job.error
        if job.kv is not None:
            job.kv.apply(job.plan)
            job.kv.truncate(job.kv.prefix_len)


def measure(model, size: int, contexts: list[int], new: int, repeats: int) -> tuple[float, float, float]:
    """(batched pass seconds, of which the model's forward, seconds of the same plans run alone one
    after another): medians."""
    timed = _TimedModel(model)
    batcher = ForwardBatcher(timed, BatchConfig(window_ms=0, max_batch_tokens=10**9))
    caches = _sessions(model, batcher, size, contexts)
    batched, forward, alone = [], [], []
    for repeat in range(repeats + 1):
        jobs = _plans(caches, new)
        timed.seconds = 0.0
        began = time.perf_counter()
        batcher._execute(jobs)
        took = time.perf_counter() - began
        took_forward = timed.seconds
        _undo(jobs)
        jobs = _plans(caches, new)
        began = time.perf_counter()
        for job in jobs:
            batcher._execute([job])
        took_alone = time.perf_counter() - began
        _undo(jobs)
        if repeat:  # the first is a warm-up
            batched.append(took)
            forward.append(took_forward if size > 1 else took)
            alone.append(took_alone)
    return statistics.median(batched), statistics.median(forward), statistics.median(alone)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.bench_batching", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-coder-1.5b")
    p.add_argument("--dtype", default="int8")
    p.add_argument("--threads", type=int, default=1, help="torch threads (`up` on 2 cores: 1)")
    p.add_argument("--sizes", default="1,2,4,8,16")
    p.add_argument("--context", default="120,400", help="cache lengths the sessions take in turn")
    p.add_argument("--new", type=int, default=3, help="new tokens per session and pass")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    loaded = load_model(resolve_model(args.model, "model"), dtype=args.dtype, threads=args.threads)
    contexts = [int(x) for x in args.context.split(",")]
    print(f"{cpu_model()}, {os.cpu_count()} CPUs; {args.model} {args.dtype}, {args.threads} thread(s); "
          f"contexts {contexts}, {args.new} new tokens per session; medians of {args.repeats}")
    print("\n| sessions | batch tokens | batched pass | of it, the forward | per session | alone, one by one "
          "| gain |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for size in (int(x) for x in args.sizes.split(",")):
        batched, forward, alone = measure(loaded.model, size, contexts, args.new, args.repeats)
        print(f"| {size} | {size * args.new} | {batched * 1000:.0f} ms | {forward * 1000:.0f} ms | "
              f"{batched * 1000 / size:.0f} ms | {alone * 1000:.0f} ms | {alone / batched:.2f}x |",
              flush=True)


if __name__ == "__main__":
    sys.exit(main())

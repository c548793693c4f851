"""Ragged against padded batched passes (specdec.runtime.ragged), on the real model.

    python -m bench.bench_ragged --model qwen2.5-coder-1.5b --dtype int8 --threads 2 \\
        --context 500 --widths 1,4,8,2,6,3,5 --chunk 128 --repeats 5

Three mixes of calls, each run in both layouts, alternated repeat by repeat (medians after one
warm-up):
- decode calls of `--widths` new tokens each (sessions holding `--context` entries) beside one
  prompt's prefill chunk of `--chunk` tokens: padded, the chunk runs in a pass of its own and the
  decode calls in a padded pass (two passes); ragged, all in one pass;
- the same decode calls alone (mixed widths: padding against none);
- as many decode calls of one width (the widths' median): no padding either way, so this shows
  what the ragged pass's per-session attention costs.
Rows are query rows of the passes (padding included); padding is their share that no call asked for.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from bench.bench_batching import _sessions, _TimedModel, _undo
from bench.machine import cpu_model
from specdec.cli.common import resolve_model
from specdec.runtime.batch_config import BatchConfig
from specdec.runtime.batching import ForwardBatcher, _Job
from specdec.runtime.kv import TreeKVCache, model_device_dtype
from specdec.runtime.loading import load_model


def _decode_jobs(caches: list[TreeKVCache], widths: list[int]) -> list[_Job]:
    vocab = caches[0].model.config.vocab_size
    return [_Job(kv=kv, plan=kv.plan([(11 + t) % vocab for t in range(n)], list(range(-1, n - 1)), 0))
            for kv, n in zip(caches, widths, strict=True)]


def _chunk_job(kv: TreeKVCache, chunk: int, ragged: bool) -> _Job:
    """The prompt's next chunk: a prefill job of a ragged pass, or (padded) the pass of its own that
    TreeKVCache.prefill runs there (the model's causal mask, one logits row)."""
    vocab = kv.model.config.vocab_size
    tokens = [(300 + t) % vocab for t in range(chunk)]
    if ragged:
        return _Job(kv=kv, plan=kv.plan(tokens, list(range(-1, chunk - 1)), chunk - 1), prefill=True)
    start = kv.prefix_len

    def run() -> None:
        kv.causal_pass(tokens, model_device_dtype(kv.model)[0])
        kv.drop_entries_after(start)

    return _Job(run=run)


def _run(batcher: ForwardBatcher, passes: list[list[_Job]], chunk: int) -> tuple[float, int, int]:
    """Seconds, rows (padding included) and the calls' own positions of `passes`, run in turn."""
    before = batcher.counters()
    began = time.perf_counter()
    for batch in passes:
        batcher._execute(batch)
    seconds = time.perf_counter() - began
    after = batcher.counters()
    alone = chunk * sum(1 for batch in passes for job in batch if job.run is not None)
    for batch in passes:
        _undo(batch)
    return (seconds, int(after["batch_tokens"] - before["batch_tokens"]) + alone,
            int(after["batch_positions"] - before["batch_positions"]) + alone)


def measure(model, widths: list[int], context: int, chunk: int, repeats: int) -> list[tuple]:
    """Rows of the table: (mix, layout, median seconds, rows, padding share)."""
    timed = _TimedModel(model)
    layouts = {name: ForwardBatcher(timed, BatchConfig(window_ms=0, max_batch_tokens=10**9, layout=name))
               for name in ("padded", "ragged")}
    assert layouts["ragged"].joins_prefill, "this model's attention has no ragged passes"
    runner = layouts["ragged"]
    decoders = _sessions(model, runner, len(widths), [context])
    prompt = _sessions(model, runner, 1, [context])[0]
    uniform = [int(statistics.median(widths))] * len(widths)

    def mixes(layout: str) -> dict[str, list[list[_Job]]]:
        chunk_job, decode = _chunk_job(prompt, chunk, layout == "ragged"), _decode_jobs(decoders, widths)
        mixed = [[chunk_job], decode] if layout == "padded" else [[chunk_job, *decode]]
        return {"decode + a prefill chunk": mixed,
                "decode, mixed widths": [_decode_jobs(decoders, widths)],
                "decode, one width": [_decode_jobs(decoders, uniform)]}

    times: dict[tuple[str, str], list[float]] = {}
    shape: dict[tuple[str, str], tuple[int, int]] = {}
    for repeat in range(repeats + 1):
        for layout in (("padded", "ragged") if repeat % 2 else ("ragged", "padded")):
            for mix, passes in mixes(layout).items():
                seconds, rows, own = _run(layouts[layout], passes, chunk)
                if repeat:  # the first is a warm-up
                    times.setdefault((mix, layout), []).append(seconds)
                    shape[(mix, layout)] = (rows, own)
    return [(mix, layout, statistics.median(values), shape[(mix, layout)][0],
             1 - shape[(mix, layout)][1] / shape[(mix, layout)][0])
            for (mix, layout), values in times.items()]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.bench_ragged", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-coder-1.5b")
    p.add_argument("--dtype", default="int8")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--context", type=int, default=500, help="cache entries every session holds")
    p.add_argument("--widths", default="1,4,8,2,6,3,5", help="new tokens of each decode call")
    p.add_argument("--chunk", type=int, default=128, help="the prefill chunk's tokens")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    loaded = load_model(resolve_model(args.model, "model"), dtype=args.dtype, threads=args.threads)
    widths = [int(x) for x in args.widths.split(",")]
    print(f"{cpu_model()}, {os.cpu_count()} CPUs; {args.model} {args.dtype}, {args.threads} thread(s); "
          f"{len(widths)} decode calls of {widths} new tokens over {args.context} cached; a prefill chunk of "
          f"{args.chunk}; medians of {args.repeats}, layouts alternated")
    print("\n| calls | layout | passes' time | rows | padding |")
    print("|---|---|---:|---:|---:|")
    for mix, layout, seconds, rows, padding in sorted(measure(loaded.model, widths, args.context, args.chunk,
                                                              args.repeats)):
        print(f"| {mix} | {layout} | {seconds * 1000:.0f} ms | {rows} | {padding:.0%} |", flush=True)


if __name__ == "__main__":
    sys.exit(main())

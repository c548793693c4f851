"""Cost of the model-free proposers (specdec.model_free): propose and sync times, memory per cached token.

A synthetic workload with code-like repetition: requests are drawn from a small order-2 Markov
"language" over a 32k vocabulary (so n-grams recur, as in code), plus whole shared prefixes.
Measured: the global cache's memory per cached token (tracemalloc, which sees numpy's buffers),
start/finish of a long request, and per-iteration sync + propose on a long active context
(medians and p99 over many iterations, one thread), as this thread's CPU time — the cost to the
orchestrator's event loop, without a shared machine's preemptions — and as wall time.

    python -m bench.bench_model_free                        # 30k context, a 250k-token cache
    python -m bench.bench_model_free --context 8000 --cache-tokens 65536
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time
import tracemalloc

from specdec.model_free import PromptLookup, SuffixCache


def language(seed: int, vocab: int = 32_000, branching: int = 4):
    """An order-2 Markov source: each bigram has a few likely successors."""
    rng = random.Random(seed)
    table: dict[tuple[int, int], list[int]] = {}

    def generate(length: int, prefix: list[int] | None = None) -> list[int]:
        out = list(prefix or [rng.randrange(vocab), rng.randrange(vocab)])
        while len(out) < length:
            key = (out[-2], out[-1])
            options = table.get(key)
            if options is None:
                options = table[key] = [rng.randrange(vocab) for _ in range(branching)]
            out.append(options[0] if rng.random() < 0.6 else rng.choice(options)
                       if rng.random() < 0.9 else rng.randrange(vocab))
        return out

    return generate


def requests(generate, total: int, per_request: int) -> list[list[int]]:
    """Requests of `per_request` tokens, `total` in all; every fourth one opens with a shared prefix."""
    shared = generate(200)
    return [generate(per_request, shared if i % 4 == 0 else None) for i in range(total // per_request)]


def fill_cache(cache: SuffixCache, batch: list[list[int]]) -> tuple[float, float]:
    """Start and finish each request; returns the mean and the max CPU time of a finish (ms)."""
    times = []
    for i, tokens in enumerate(batch):
        cache.start(("cached", i), tokens)
        t0 = time.thread_time()
        cache.finish(("cached", i))
        times.append(time.thread_time() - t0)
    return 1e3 * statistics.mean(times), 1e3 * max(times)


def measure(context: int, cache_tokens: int, per_request: int, iterations: int) -> dict[str, float]:
    generate = language(0)
    results: dict[str, float] = {}
    # the machine's speed at plain Python, to scale the numbers below by (a few ms on a current core)
    t0 = time.thread_time()
    sum(i * i for i in range(300_000))
    results["calibration_python_loop_cpu_ms"] = 1e3 * (time.thread_time() - t0)
    batch = requests(generate, 2 * cache_tokens, per_request)  # twice the cache: evictions too
    sequence = generate(context + iterations * 4)

    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    cache = SuffixCache(max_tokens=cache_tokens, max_requests=10**9)
    results["finish_cpu_ms_mean"], results["finish_cpu_ms_max"] = fill_cache(cache, batch)
    del batch
    gc.collect()
    after, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    results["cached_tokens"] = cache.cached_tokens
    results["bytes_per_cached_token"] = (after - before) / cache.cached_tokens
    results["peak_bytes_per_cached_token"] = (peak - before) / cache.cached_tokens

    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    t0 = time.thread_time()
    cache.start("live", sequence[:context])
    results["start_cpu_ms"] = 1e3 * (time.thread_time() - t0)
    results["active_bytes_per_token"] = (tracemalloc.get_traced_memory()[0] - before) / context
    lookup = PromptLookup()
    before = tracemalloc.get_traced_memory()[0]
    t0 = time.thread_time()
    lookup.sync(sequence[:context])
    results["lookup_first_sync_cpu_ms"] = 1e3 * (time.thread_time() - t0)
    results["lookup_bytes_per_token"] = (tracemalloc.get_traced_memory()[0] - before) / context
    tracemalloc.stop()
    long_request = SuffixCache()
    long_request.start("long", sequence[:context])
    t0 = time.thread_time()
    long_request.finish("long")
    results["finish_long_request_cpu_ms"] = 1e3 * (time.thread_time() - t0)

    # CPU time of this thread (the cost to an event loop; a shared machine's preemptions drop out)
    # and wall time
    clocks = {"cpu": time.thread_time, "wall": time.perf_counter}
    times: dict[str, list[float]] = {f"{what}_{clock}": [] for what in ("sync", "suffix", "lookup")
                                     for clock in clocks}
    length = context
    rng = random.Random(1)
    hits = 0
    for _ in range(iterations):
        length += rng.randint(1, 4)
        prefix = sequence[:length]
        for what, call in (("sync", lambda prefix=prefix: (cache.sync("live", prefix), lookup.sync(prefix))),
                           ("suffix", lambda: cache.propose("live", max_nodes=16)),
                           ("lookup", lookup.propose)):
            c0, w0 = time.thread_time(), time.perf_counter()
            out = call()
            times[f"{what}_cpu"].append(time.thread_time() - c0)
            times[f"{what}_wall"].append(time.perf_counter() - w0)
            if what == "suffix":
                hits += out is not None
    for name, values in times.items():
        values.sort()
        results[f"{name}_us_median"] = 1e6 * statistics.median(values)
        results[f"{name}_us_p99"] = 1e6 * values[int(0.99 * len(values))]
    results["suffix_hit_rate"] = hits / iterations

    # the worst case for occurrence lists: one token repeated
    repeat = [7] * 50_000
    cache.start("repeat", repeat)
    lookup = PromptLookup()
    lookup.sync(repeat)
    t0 = time.thread_time()
    for _ in range(100):
        cache.propose("repeat", max_nodes=16)
    t1 = time.thread_time()
    for _ in range(100):
        lookup.propose()
    t2 = time.thread_time()
    results["repeat_suffix_cpu_us"] = 1e4 * (t1 - t0)
    results["repeat_lookup_cpu_us"] = 1e4 * (t2 - t1)
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=30_000)
    parser.add_argument("--cache-tokens", type=int, default=262_144)
    parser.add_argument("--per-request", type=int, default=1_000)
    parser.add_argument("--iterations", type=int, default=2_000)
    args = parser.parse_args(argv)
    for name, value in measure(args.context, args.cache_tokens, args.per_request, args.iterations).items():
        print(f"{name:32s} {value:12.2f}")


if __name__ == "__main__":
    main()

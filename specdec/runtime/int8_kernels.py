"""Which int8 GEMM runs a call, by its rows, its weight's shape and this CPU: measured, then kept.

fbgemm's kernel is the fastest for one row of most shapes on every CPU we measured (0.58 ms for one
row of the default target's 1536 × 17920 gate-and-up product on an AMX Xeon, 2 threads), but it
falls far behind oneDNN for a wide pass there: 8.2 ms at 128 rows against 2.1 ms for oneDNN's
quantised linear (AMX tiles) and 8.8 ms for `torch._int_mm` (oneDNN's s8 GEMM, no AMX). On an AVX2
EPYC without VNNI fbgemm won every shape at every count, and `_int_mm` was a fallback loop (144
times fbgemm's time at 256 rows). So the choice is measured on the machine: per distinct weight
shape, fbgemm and each wide kernel at a few row counts, the fastest of a few calls, alternated
(`measure`). Each wide kernel would run every call from the smallest count on which it wins (by a
margin, at that count and every larger one measured); the one kept is the one whose switch makes
the measured calls cheapest (`best_wide`), and a prompt's prefill runs in chunks at least that wide
(specdec.runtime.kv.prefill_chunk). The answer is saved under the specdec home, keyed by CPU model,
capability, torch version and threads, so a later start reads it.

Every kernel sums int8 products in int32, exactly, and scales the float sum once, so rows are
bitwise the same whichever kernel ran (docs/algorithms.md §14); only time and memory change. A
shape that switches holds a second copy of its int8 weight, in the wide kernel's layout.

`SPECDEC_INT8_KERNELS`: `auto` (the default: measured), `fbgemm` (never switch), `int_mm`, `onednn`
or `vnni` (that kernel for every call from one row on, e.g. to check a non-deprecated path alone).
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import os
import platform
import time
from collections.abc import Callable, Iterable, Sequence
from contextlib import nullcontext
from pathlib import Path

import torch

from specdec.runtime.cpuinfo import CPU_CACHES, cpuinfo_field, largest_cache_bytes
from specdec.runtime.file_lock import file_lock
from specdec.runtime.int8 import (
    FBGEMM,
    INT_MM,
    ONEDNN,
    VNNI,
    WIDE_KERNELS,
    Int8Product,
    onednn_input_zero_point,
    quantize_rows,
    vnni_available,
)

log = logging.getLogger(__name__)

KERNELS_ENV = "SPECDEC_INT8_KERNELS"
KERNEL_MODES = ("auto", FBGEMM, *WIDE_KERNELS)
CACHE_FILE = "int8-kernels-6.json"  # {cpu key: {"KxN": [wide kernel, rows] or null}}
# row counts measured: a decode step, chains and trees, prefill chunks, a long prefill
ROW_GRID = (1, 4, 9, 16, 64, 128, 256)
WIDE_ROWS_ATTRIBUTE = "specdec_int8_wide_rows"  # set on the model: the smallest switch-over row count
WIDE_KERNEL_ATTRIBUTE = "specdec_int8_wide_kernel"  # and the layers' wide kernel, where they agree
MARGIN = 0.9  # a wide kernel must take under 90 % of fbgemm's time to be chosen (measurement noise)
TIE = 1.05  # and may not take more than 105 % of it at any larger count
REPEATS = 5  # timed calls of each kernel at each row count (their fastest counts)
HOPELESS = 4.0  # a wide kernel this many times fbgemm's first call at its widest count is timed no further
MAX_CALL_SECONDS = 0.05  # a shape's grid stops where one fbgemm call takes longer (the lm_head)
SWEEP_BYTES = 64 << 20  # weights a timed sweep reads where the CPU does not say its cache sizes
MAX_SWEEP_BYTES = 1 << 30
NEVER = 1 << 62  # a switch-over no call reaches: holds a wide kernel's weight for measuring it

Timings = dict[int, dict[str, float]]  # rows → {kernel: fastest call's seconds}
Choice = tuple[str, int] | None  # (wide kernel, from how many rows) or fbgemm only


def cpu_key(threads: int | None = None) -> str:
    """What a measurement depends on: CPU model, torch's CPU capability, torch version, threads."""
    model = cpuinfo_field("model name") or platform.machine()
    capability = torch.backends.cpu.get_cpu_capability()
    threads = torch.get_num_threads() if threads is None else threads
    return f"{model} | {capability} | torch {torch.__version__} | {threads} threads"


def wide_kernels() -> tuple[str, ...]:
    """The wide kernels this machine has: `_int_mm` always, oneDNN's quantised linear on x86 builds
    where it sums exactly (specdec.runtime.int8.onednn_input_zero_point), specdec's own VNNI kernel
    where the CPU has AVX-512 VNNI and a C compiler builds it."""
    onednn = (ONEDNN,) if onednn_input_zero_point() is not None else ()
    return (INT_MM, *onednn, *((VNNI,) if vnni_available() else ()))


def crossover(timings: Timings, kernel: str) -> int | None:
    """The smallest measured row count where `kernel` beats fbgemm (by MARGIN) with no larger count
    where it loses (slower than TIE times fbgemm's time), else None. Level at the widest counts is
    no loss: the VNNI kernel wins most at 9–64 rows and draws with fbgemm at 128–256 for some shapes.
    Below a win the switch goes on down through the counts where the kernel is level (within TIE):
    a call of a few rows costs either kernel about the weight's read, timed level within the host's
    noise, and one kernel for every count is one layout of the weight held and read (on a Zen 4
    EPYC passes of 1 row with the VNNI kernel for every call were level with fbgemm's or faster:
    68 against 69 ms in one run, 48 against 57 in another)."""
    threshold = None
    for rows in sorted(timings, reverse=True):
        seconds = timings[rows].get(kernel)
        if seconds is None or seconds >= TIE * timings[rows][FBGEMM]:
            break
        if threshold is not None or seconds < MARGIN * timings[rows][FBGEMM]:
            threshold = rows
    return threshold


def best_wide(timings: Timings) -> Choice:
    """The wide kernel and crossover that make the measured calls cheapest, each row count's time
    taken relative to fbgemm's (so a wide pass does not outweigh a narrow one); None where no wide
    kernel beats fbgemm."""
    kernels = sorted({kernel for by_kernel in timings.values() for kernel in by_kernel} - {FBGEMM})
    best: tuple[float, str, int] | None = None
    for kernel in kernels:
        rows = crossover(timings, kernel)
        if rows is None:
            continue
        cost = sum((by_kernel[kernel] if count >= rows else by_kernel[FBGEMM]) / by_kernel[FBGEMM]
                   for count, by_kernel in timings.items())
        if best is None or cost < best[0]:
            best = (cost, kernel, rows)
    return None if best is None else (best[1], best[2])


def _hopeless(seconds: float, fbgemm_seconds: float) -> bool:
    """A wide kernel this slow against fbgemm is a fallback loop on this CPU: timed no further."""
    return seconds > HOPELESS * fbgemm_seconds


def sweep_bytes(caches: Path = CPU_CACHES) -> int:
    """Weight bytes one timed sweep of `measure` reads: twice the CPU's largest cache (SWEEP_BYTES
    where sysfs does not say), at most MAX_SWEEP_BYTES."""
    largest = largest_cache_bytes(caches)
    return SWEEP_BYTES if largest is None else min(2 * largest, MAX_SWEEP_BYTES)


def _seconds(product: Int8Product, codes: torch.Tensor, kernel: str) -> float:
    began = time.perf_counter()
    product.gemm(codes, kernel)
    return time.perf_counter() - began


def _switch(product: Int8Product, choice: Choice) -> None:
    if choice is None:
        product.run_wide_from(None)
    else:
        product.run_wide_from(choice[1], choice[0])


def measure(group: Int8Product | Sequence[Int8Product], rows_grid: Iterable[int] = ROW_GRID,
            repeats: int = REPEATS, kernels: Iterable[str] | None = None,
            exhaustive: bool = False) -> Timings:
    """fbgemm's and each wide kernel's fastest call, in seconds, for the GEMM of one weight shape on
    random rows of its input width; `group`: the products of that shape (a model's layers), each
    left with the kernels it had.

    Made to time what a pass times, to hold on a shared host, and to stay short where a wide kernel
    is slow:
    - a timed call is the mean of one call on each product of a pool, in turn (the first products
      of the group, enough to read twice the largest cache), so each reads its weight from memory
      as a pass's calls do, one layer after another; one call repeated on one weight finds it in
      the cache. On a Zen 4 EPYC, timed on one weight, the VNNI kernel was level with fbgemm at
      1-4 rows and kept off them (and off the o projection), but passes of 10 rows with it for
      every call took 79-80 ms against 86-96 under that choice (bench/RESULTS.md, "Kernels timed
      as a pass reads its weights");
    - the fastest of `repeats` calls, not the median: other work on the host only adds time;
    - a wide kernel's calls alternate with fbgemm's on the same rows, so a burst of load lands on
      both sides of the comparison, and it is compared with those calls alone (as many on each
      side); a loss is timed once more before it counts;
    - a wide kernel is timed from the widest count down and stops at the first count where it
      loses (slower than TIE times fbgemm: crossover looks no further), or after one call where it
      is a fallback loop (HOPELESS times fbgemm's: `_int_mm` without AVX-512 took 144 times
      fbgemm's time at 256 rows on an AVX2 EPYC, and measuring it everywhere took that CPU 10
      minutes).
    `exhaustive` times every kernel at every count instead (the benchmark's full table).
    The pool's products hold fbgemm's weight while measured, and the wide kernel's while it is timed
    (copies let go after, as each product's switch had it).
    """
    group = [group] if isinstance(group, Int8Product) else list(group)
    inputs, outputs = group[0].shape
    # The products the calls take in turn: enough that the weights read before a call comes back
    # to one exceed the caches (SWEEP_BYTES or twice the largest cache); the rest stay as they are.
    pool = group[:max(1, -(-sweep_bytes() // (inputs * outputs)))]
    had = [None if p.wide_kernel is None else (p.wide_kernel, p.wide_from_rows) for p in pool]
    for product in pool:  # fbgemm's copy held (a product switched from one row let it go)
        product.run_wide_from(None)
    turn, sweep = itertools.cycle(pool), len(pool)
    timings: Timings = {}
    inputs_by_rows: dict[int, torch.Tensor] = {}
    generator = torch.Generator().manual_seed(0)

    def seconds(codes: torch.Tensor, kernel: str) -> float:
        """One call's time: the mean over a sweep of the pool, each product in turn."""
        return sum(_seconds(next(turn), codes, kernel) for _ in range(sweep)) / sweep

    try:
        with torch.inference_mode():
            for rows in sorted(rows_grid):
                codes, _ = quantize_rows(torch.randn(rows, inputs, generator=generator))
                inputs_by_rows[rows] = codes
                seconds(codes, FBGEMM)  # warm-up (packing caches), not counted
                timings[rows] = {FBGEMM: min(seconds(codes, FBGEMM) for _ in range(repeats))}
                if timings[rows][FBGEMM] > MAX_CALL_SECONDS:
                    break
            for kernel in wide_kernels() if kernels is None else kernels:
                for product in pool:
                    product.run_wide_from(NEVER, kernel)  # its weight, for the measurement only
                for rows in sorted(timings, reverse=True):
                    codes, by_kernel = inputs_by_rows[rows], timings[rows]
                    # one call first (and oneDNN's primitive for this shape): a fallback loop shows
                    # at once, where a sweep of it over the pool took 3 minutes (oneDNN on a Zen 4)
                    first = _seconds(next(turn), codes, kernel)
                    if _hopeless(first, by_kernel[FBGEMM]) and not exhaustive:
                        by_kernel[kernel] = first
                        break
                    fastest = first if sweep == 1 else math.inf
                    beside = math.inf  # fbgemm's fastest among the calls alternated with these
                    for _attempt in range(2):  # a loss is timed once more: a burst of load can fake it
                        for _ in range(repeats):
                            beside = min(beside, seconds(codes, FBGEMM))
                            fastest = min(fastest, seconds(codes, kernel))
                        if fastest < TIE * beside:
                            break
                    # kept as fbgemm's time times the ratio of the alternated calls: fbgemm's own
                    # figure is the fastest of more calls (its first round and every kernel's), and
                    # a minimum over more calls comes out lower, so against it the wide kernel took
                    # 1.1-1.4 times fbgemm's time at 4 rows in one grid and 0.9-1.0 in the next
                    by_kernel[kernel] = fastest * (by_kernel[FBGEMM] / beside)
                    if fastest >= TIE * beside and not exhaustive:
                        break
    finally:
        for product, choice in zip(pool, had, strict=True):
            _switch(product, choice)
    return timings


def products(model: torch.nn.Module) -> list[Int8Product]:
    """The distinct int8 products of a model made by quantize_linears (shared ones once)."""
    from specdec.runtime.int8 import RowwiseInt8Linear

    seen: dict[int, Int8Product] = {}
    for module in model.modules():
        if isinstance(module, RowwiseInt8Linear):
            seen.setdefault(id(module.product), module.product)
    return list(seen.values())


def _read_cache(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_cache(path: Path, data: dict) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_suffix(f".{os.getpid()}.tmp")
        temporary.write_text(json.dumps(data, indent=1, sort_keys=True))
        temporary.replace(path)
    except OSError as exc:  # a read-only home costs a measurement per start, nothing else
        log.warning("could not save the int8 kernel choice to %s: %s", path, exc)


def _saved(value: object) -> tuple[bool, Choice]:
    """(whether `value` is a saved choice, the choice) for one shape's entry of the cache."""
    if value is None:
        return True, None
    if (isinstance(value, list) and len(value) == 2 and value[0] in WIDE_KERNELS
            and isinstance(value[1], int) and value[1] > 0):
        return (value[0] in wide_kernels()), (value[0], value[1])
    return False, None


def _known(cache: Path | None, key: str) -> tuple[dict, dict]:
    """(the whole cache file, its entries for this CPU key); empty where there is none."""
    saved = _read_cache(cache) if cache is not None else {}
    return saved, (saved[key] if isinstance(saved.get(key), dict) else {})


def _saved_choices(known: dict, by_shape: dict[str, list[Int8Product]]) -> dict[str, Choice]:
    """The saved choices of the shapes `known` (one CPU key's entries) holds a valid one for."""
    choice: dict[str, Choice] = {}
    for shape in by_shape:
        valid, kept = _saved(known.get(shape, False))
        if valid:
            choice[shape] = kept
    return choice


def _size(product: Int8Product) -> int:
    return product.shape[0] * product.shape[1]


def fallback_loop(timings: Timings, kernel: str) -> bool:
    """Whether `kernel` took HOPELESS times fbgemm's time at the widest count it was timed at."""
    timed = [rows for rows in timings if kernel in timings[rows]]
    return bool(timed) and _hopeless(timings[max(timed)][kernel], timings[max(timed)][FBGEMM])


MeasureFn = Callable[[Sequence[Int8Product], Iterable[str]], Timings]  # (a shape's products, wide kernels)


def _measure_with(group: Sequence[Int8Product], kernels: Iterable[str]) -> Timings:
    return measure(group, kernels=kernels)


def _measured_choices(by_shape: dict[str, list[Int8Product]], cache: Path | None,
                      measure_fn: MeasureFn) -> dict[str, Choice]:
    """The saved choice for each shape this CPU key has one for, the others measured and saved.

    Measuring holds a lock beside the cache: engines starting together on one host (a drafter and
    a verifier) would otherwise time their kernels against each other's load, and the slower
    figures would be kept for good. The second re-reads what the first saved.
    """
    key = cpu_key()
    choice = _saved_choices(_known(cache, key)[1], by_shape)
    if len(choice) == len(by_shape):  # the usual start: nothing to measure, no lock to wait for
        return choice
    lock = nullcontext() if cache is None else file_lock(cache.with_name(f".{cache.name}.lock"))
    with lock:
        saved, known = _known(cache, key)
        choice = _saved_choices(known, by_shape)  # with what another engine saved meanwhile
        kernels = list(wide_kernels())
        # smallest shape first: a kernel that is a fallback loop on this CPU is found there, cheaply,
        # and not timed on the others (on the AVX2 EPYC _int_mm's one call on the vocabulary took 20 s)
        for shape, group in sorted(by_shape.items(), key=lambda item: _size(item[1][0])):
            if shape in choice:
                continue
            timings = measure_fn(group, kernels)
            kernels = [kernel for kernel in kernels if not fallback_loop(timings, kernel)]
            choice[shape] = best_wide(timings)
            log.info("int8 kernels for %s (ms by rows): %s → %s", shape,
                     {rows: {k: round(v * 1e3, 3) for k, v in by_kernel.items()}
                      for rows, by_kernel in timings.items()}, choice[shape] or "fbgemm only")
        stored = {shape: (None if c is None else list(c)) for shape, c in choice.items()}
        if cache is not None and stored != known:
            saved[key] = {**known, **stored}
            _write_cache(cache, saved)
    return choice


def choose_kernels(model: torch.nn.Module, cache: Path | None, mode: str | None = None,
                   measure_fn: MeasureFn | None = None) -> dict[str, Choice]:
    """Set every product's wide kernel and switch-over for this CPU; returns {"KxN": (kernel, rows)
    or None}.

    `cache` (a JSON file, None: none) keeps the measured choice per CPU key and shape.
    """
    mode = (mode or os.environ.get(KERNELS_ENV) or "auto").strip().lower()
    if mode not in KERNEL_MODES:
        raise ValueError(f"{KERNELS_ENV} must be one of {', '.join(KERNEL_MODES)}, got {mode!r}")
    if mode == ONEDNN and ONEDNN not in wide_kernels():
        raise ValueError(f"{KERNELS_ENV}=onednn: this torch build has no oneDNN quantised linear "
                         "that sums int8 codes exactly on this CPU")
    if mode == VNNI and not vnni_available():
        raise ValueError(f"{KERNELS_ENV}=vnni: specdec's VNNI kernel does not run here (it needs "
                         "AVX-512 VNNI and a C compiler)")
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head = getattr(output, "product", None)
    switchable = [p for p in products(model) if p.kernel == FBGEMM]
    by_shape: dict[str, list[Int8Product]] = {}
    for product in switchable:
        by_shape.setdefault(f"{product.shape[0]}x{product.shape[1]}", []).append(product)
    choice: dict[str, Choice]
    if mode == FBGEMM:
        choice = {shape: None for shape in by_shape}
    elif mode != "auto":
        choice = {shape: (mode, 1) for shape in by_shape}
    else:
        choice = _measured_choices(by_shape, cache, measure_fn or _measure_with)
    for shape, group in by_shape.items():
        for product in group:
            _switch(product, choice[shape])
    # A prefill can then run in passes wide enough for the layers' faster kernel (specdec.runtime.kv);
    # the vocabulary projection sees one row a prefill, so it does not count
    layers = [c for shape, c in choice.items() if not (head is not None and head in by_shape[shape])]
    thresholds = [c[1] for c in layers if c is not None]
    setattr(model, WIDE_ROWS_ATTRIBUTE, min(thresholds) if thresholds else None)
    kernels = {None if c is None else c[0] for c in layers}
    setattr(model, WIDE_KERNEL_ATTRIBUTE, kernels.pop() if len(kernels) == 1 else None)
    return choice

"""Which int8 GEMM runs a call, by its rows, its weight's shape and this CPU: measured, then kept.

fbgemm's kernel is the fastest for a few rows on every CPU we measured (0.57 ms for one row of a
1536 × 8960 layer on an AVX2 EPYC, 0.68 ms on an AMX Xeon), but on the AMX Xeon it falls far
behind oneDNN's `torch._int_mm` for a wide pass (18.3 against 6.7 ms at 256 rows), while on the
EPYC the two are level there. So the choice is measured on the machine: per distinct weight shape,
both kernels at a few row counts, and calls from the smallest count on which `_int_mm` wins (by a
margin, at that count and every larger one measured) run `_int_mm`, and a prompt's prefill runs
in chunks at least that wide (specdec.runtime.kv.prefill_chunk). The answer is saved under the
specdec home, keyed by CPU model, capability, torch version and threads, so a later start reads it.

Every kernel sums int8 products in int32, exactly, so rows are bitwise the same whichever kernel
ran (docs/algorithms.md §14); only time and memory change. A shape that switches holds a second
copy of its int8 weight.

`SPECDEC_INT8_KERNELS`: `auto` (the default: measured), `fbgemm` (never switch) or `int_mm` (every
call from one row on, e.g. to check the non-deprecated path alone).
"""

from __future__ import annotations

import json
import logging
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from specdec.runtime.cpuinfo import cpuinfo_field
from specdec.runtime.int8 import FBGEMM, INT_MM, Int8Product

log = logging.getLogger(__name__)

KERNELS_ENV = "SPECDEC_INT8_KERNELS"
KERNEL_MODES = ("auto", FBGEMM, INT_MM)
CACHE_FILE = "int8-kernels.json"
ROW_GRID = (16, 64, 128, 256)  # row counts measured: a wide tree, prefill chunks, a long prefill
WIDE_ROWS_ATTRIBUTE = "specdec_int8_wide_rows"  # set on the model: the smallest switch-over row count
MARGIN = 0.9  # _int_mm must take under 90 % of fbgemm's time to be chosen (measurement noise)
MAX_CALL_SECONDS = 0.05  # a shape's grid stops where one fbgemm call takes longer (the lm_head)

Timings = dict[int, tuple[float, float]]  # rows → (fbgemm seconds, _int_mm seconds)


def cpu_key(threads: int | None = None) -> str:
    """What a measurement depends on: CPU model, torch's CPU capability, torch version, threads."""
    model = cpuinfo_field("model name") or platform.machine()
    capability = torch.backends.cpu.get_cpu_capability()
    threads = torch.get_num_threads() if threads is None else threads
    return f"{model} | {capability} | torch {torch.__version__} | {threads} threads"


def crossover(timings: Timings) -> int | None:
    """The smallest measured row count from which `_int_mm` wins at every larger count, else None."""
    threshold = None
    for rows in sorted(timings, reverse=True):
        fbgemm, int_mm = timings[rows]
        if int_mm < MARGIN * fbgemm:
            threshold = rows
        else:
            break
    return threshold


def _median_seconds(product: Int8Product, codes: torch.Tensor, kernel: str, repeats: int) -> float:
    product.gemm(codes, kernel)  # warm-up: packing caches, oneDNN's primitive for this shape
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        product.gemm(codes, kernel)
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def measure(product: Int8Product, rows_grid: Iterable[int] = ROW_GRID, repeats: int = 3) -> Timings:
    """Both kernels' median seconds for the GEMM of `product` on random rows of its input width."""
    from specdec.runtime.int8 import quantize_rows

    inputs, _ = product.shape
    had_int_mm = product.int_mm_from_rows is not None
    if not had_int_mm:
        product.run_int_mm_from(1 << 62)  # holds the _int_mm weight for the measurement only
    timings: Timings = {}
    generator = torch.Generator().manual_seed(0)
    try:
        with torch.inference_mode():
            for rows in sorted(rows_grid):
                codes, _ = quantize_rows(torch.randn(rows, inputs, generator=generator))
                fast = _median_seconds(product, codes, FBGEMM, repeats)
                timings[rows] = (fast, _median_seconds(product, codes, INT_MM, repeats))
                if fast > MAX_CALL_SECONDS:
                    break
    finally:
        if not had_int_mm:
            product.run_int_mm_from(None)
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


def choose_kernels(model: torch.nn.Module, cache: Path | None, mode: str | None = None,
                   measure_fn: Callable[[Int8Product], Timings] = measure) -> dict[str, int | None]:
    """Set every product's switch-over row count for this CPU; returns {"KxN": rows or None}.

    `cache` (a JSON file, None: none) keeps the measured choice per CPU key and shape.
    """
    mode = (mode or os.environ.get(KERNELS_ENV) or "auto").strip().lower()
    if mode not in KERNEL_MODES:
        raise ValueError(f"{KERNELS_ENV} must be one of {', '.join(KERNEL_MODES)}, got {mode!r}")
    # The vocabulary projection sees only the rows a pass keeps (one at prefill, a tree's at
    # verify), never a wide pass, and is the costliest shape to measure: it stays on fbgemm.
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head = getattr(output, "product", None)
    switchable = [p for p in products(model) if p.kernel == FBGEMM and p is not head]
    by_shape: dict[str, list[Int8Product]] = {}
    for product in switchable:
        by_shape.setdefault(f"{product.shape[0]}x{product.shape[1]}", []).append(product)
    if mode != "auto":
        choice = {shape: (1 if mode == INT_MM else None) for shape in by_shape}
    else:
        key = cpu_key()
        saved = _read_cache(cache) if cache is not None else {}
        known = saved.get(key, {}) if isinstance(saved.get(key), dict) else {}
        choice = {}
        for shape, group in by_shape.items():
            if shape in known and (known[shape] is None or isinstance(known[shape], int)):
                choice[shape] = known[shape]
                continue
            timings = measure_fn(group[0])
            choice[shape] = crossover(timings)
            log.info("int8 kernels for %s: %s → _int_mm from %s rows", shape,
                     {rows: (round(a * 1e3, 3), round(b * 1e3, 3)) for rows, (a, b) in timings.items()},
                     choice[shape])
        if cache is not None and choice != known:
            saved[key] = {**known, **choice}
            _write_cache(cache, saved)
    for shape, group in by_shape.items():
        for product in group:
            product.run_int_mm_from(choice[shape])
    # A prefill can then run in passes wide enough for the faster kernel (specdec.runtime.kv)
    thresholds = [rows for rows in choice.values() if rows is not None]
    setattr(model, WIDE_ROWS_ATTRIBUTE, min(thresholds) if thresholds else None)
    return choice

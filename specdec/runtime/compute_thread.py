"""One thread runs an engine's heavy torch work (loading and forward passes); the others run it serially.

Why: torch's CPU parallelism here is OpenMP (GNU libgomp), and every thread that starts a parallel
region gets a team of helper threads of its own. Once the helpers of all teams outnumber the
cores, libgomp stops spinning between parallel regions and puts helpers to sleep, so every region
of every team pays a wake-up. Measured on this project's 2-vCPU machine (int8 target, 2 threads):
after a second thread had run torch work, a per-row int8 quantisation took 0.6 ms instead of
0.06 ms, a one-row int8 GEMM 0.8 ms instead of 0.6 ms, and HF `generate` from a worker thread ran
at one core's speed (1.0 CPU-seconds a second, 200-260 ms a token instead of 120-150). An engine
whose loading ran on the main thread and whose passes ran on whichever worker led the batch had
two or three teams: `up --drafter none` decoded target-only at 0.55-0.60x plain HF `generate` on
the same model, and at 0.85-0.89x with this (bench/RESULTS.md, "One thread runs the model").

So an engine process keeps exactly one team: its model is loaded and every pass runs on one
ComputeThread, and the other threads that touch torch (the engines' worker pools: verification
rules, sampling, KV bookkeeping) are set to one torch thread (`serial_torch`), which starts no
team. Results do not depend on the thread a pass runs on.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

T = TypeVar("T")


# The compute thread lets go of the GIL inside most torch ops and takes it back after each, a few
# thousand times a pass. While another thread holds it (the gRPC event loop, a worker), CPython
# makes the waiter wait up to the switch interval (5 ms by default) before asking for it back.
# Served target-only passes on a 2-vCPU AMX Xeon took 120-121 ms at 0.5 ms against 125-132 ms at
# 5 ms (iterations 127-128 against 133-141 ms; bench/RESULTS.md, "oneDNN's quantised linear on AMX").
ENGINE_SWITCH_INTERVAL_S = 0.0005


def shorten_gil_switch() -> None:
    """An engine process's GIL switch interval: the pass gets the GIL back sooner (never lengthened)."""
    sys.setswitchinterval(min(sys.getswitchinterval(), ENGINE_SWITCH_INTERVAL_S))


def _set_own_threads(threads: int) -> None:
    """This thread's torch thread count, for good. torch starts each thread's OpenMP count lazily, at
    its first parallel op, from the process-wide count *last set by any thread*; a count set before
    that start is overwritten then. So start it first, then set: otherwise a pool thread set to one
    thread becomes a second team of two once a compute thread sets two meanwhile, and a compute
    thread whose first op follows a pool's start runs on one core (tests/runtime/test_compute_thread.py)."""
    torch.get_num_threads()  # torch's per-thread lazy start, now, before the count below
    torch.set_num_threads(threads)


def serial_torch() -> None:
    """Initializer of a pool whose threads touch torch but must not start an OpenMP team."""
    _set_own_threads(1)


class ComputeThread:
    """A single thread with `threads` torch threads; `call` runs a function on it and waits."""

    def __init__(self, threads: int | None = None, name: str = "torch-compute") -> None:
        if threads is not None and threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self.threads = threads  # None: the process's torch thread count when the thread starts
        self._ident: int | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name,
                                            initializer=self._start)

    def _start(self) -> None:
        self._ident = threading.get_ident()
        _set_own_threads(self.threads or torch.get_num_threads())

    @property
    def on_it(self) -> bool:
        """Whether the calling thread is this compute thread."""
        return threading.get_ident() == self._ident

    def call(self, function: Callable[..., T], *args, **kwargs) -> T:
        """`function(*args, **kwargs)` on the compute thread (inline when already on it)."""
        if self.on_it:
            return function(*args, **kwargs)
        return self._executor.submit(function, *args, **kwargs).result()

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False)

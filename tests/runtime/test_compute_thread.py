"""An engine's torch work stays on one thread: every pass on its ComputeThread, the worker pools
single-threaded (specdec.runtime.compute_thread says why: a second OpenMP team slows all of it)."""

from __future__ import annotations

import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from specdec.runtime.batch_config import BatchConfig
from specdec.runtime.batching import ForwardBatcher
from specdec.runtime.compute_thread import (
    ENGINE_SWITCH_INTERVAL_S,
    ComputeThread,
    serial_torch,
    shorten_gil_switch,
)


def test_call_runs_on_one_thread_returns_and_raises():
    compute = ComputeThread(threads=1)
    try:
        seen = {compute.call(threading.get_ident) for _ in range(5)}
        assert len(seen) == 1 and threading.get_ident() not in seen
        assert compute.call(lambda a, b=0: a + b, 2, b=3) == 5
        with pytest.raises(ValueError, match="boom"):
            compute.call(lambda: (_ for _ in ()).throw(ValueError("boom")))
        # from the compute thread itself a call runs inline (no deadlock on the one worker)
        assert compute.call(lambda: compute.call(threading.get_ident)) in seen
    finally:
        compute.shutdown()


def test_the_compute_thread_has_its_torch_threads():
    compute = ComputeThread(threads=2)
    try:
        assert compute.call(torch.get_num_threads) == 2
    finally:
        compute.shutdown()
    with pytest.raises(ValueError, match="threads"):
        ComputeThread(threads=0)


def test_serial_torch_gives_a_pool_one_torch_thread():
    with ThreadPoolExecutor(2, initializer=serial_torch) as pool:
        assert set(pool.map(lambda _: torch.get_num_threads(), range(4))) == {1}


def test_the_compute_thread_keeps_its_count_when_another_thread_sets_one_later():
    # torch starts a thread's count at its first parallel op from the last count any thread set: a
    # compute thread started (count set) before another thread set 1 ran its passes on one core.
    before = torch.get_num_threads()
    compute = ComputeThread(threads=2)
    try:
        compute.call(lambda: None)  # started, nothing run yet
        torch.set_num_threads(1)
        assert compute.call(torch.get_num_threads) == 2
    finally:
        compute.shutdown()
        torch.set_num_threads(before)


def test_a_serial_pool_thread_stays_serial_when_a_count_is_set_after_its_start():
    # ... and a pool thread set to one, started before a compute thread set two, became a second
    # OpenMP team of two at its first op.
    before = torch.get_num_threads()
    with ThreadPoolExecutor(1, initializer=serial_torch) as pool:
        try:
            pool.submit(lambda: None).result()  # started: serial_torch ran, no op yet
            torch.set_num_threads(2)
            assert pool.submit(torch.get_num_threads).result() == 1
        finally:
            torch.set_num_threads(before)


def test_every_pass_runs_on_the_batchers_compute_thread_whoever_leads_it(tiny):
    """Calls from many threads lead passes in turn; each pass runs on the one compute thread."""
    compute = ComputeThread()
    batcher = ForwardBatcher(tiny.model, BatchConfig(window_ms=0), compute=compute)
    ran_on: list[int] = []
    lock = threading.Lock()

    def one_pass(_: int) -> None:
        def run() -> None:
            with lock:
                ran_on.append(threading.get_ident())
        batcher.alone(run)

    try:
        with ThreadPoolExecutor(4) as callers:
            list(callers.map(one_pass, range(12)))
        assert len(ran_on) == 12
        assert set(ran_on) == {compute.call(threading.get_ident)}
    finally:
        compute.shutdown()


def test_an_engine_runs_its_passes_on_the_thread_that_loaded_its_model(tiny):
    """serve loads the model on a ComputeThread and hands it on (LoadedModel.compute)."""
    from dataclasses import replace

    from specdec.engine.verifier import VerifierEngine

    compute = ComputeThread()
    try:
        engine = VerifierEngine(replace(tiny, compute=compute))
        assert engine._batcher.compute is compute
    finally:
        compute.shutdown()


def test_an_engine_process_shortens_the_gil_switch_but_never_lengthens_it():
    before = sys.getswitchinterval()
    try:
        sys.setswitchinterval(0.005)  # CPython's default
        shorten_gil_switch()
        assert sys.getswitchinterval() == pytest.approx(ENGINE_SWITCH_INTERVAL_S, rel=0.05)
        sys.setswitchinterval(0.0001)  # someone chose shorter: kept
        shorten_gil_switch()
        assert sys.getswitchinterval() == pytest.approx(0.0001, rel=0.05)
    finally:
        sys.setswitchinterval(before)

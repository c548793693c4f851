"""The in-process transport's worker threads run torch with one thread: each engine's passes run on
its model's ComputeThread, and a worker with more torch threads would start an OpenMP team of its
own and slow every parallel region (specdec.runtime.compute_thread)."""

from __future__ import annotations

import asyncio
import threading

import torch

from orchestrator.clients.inprocess import InProcessDrafterClient, InProcessVerifierClient


class _Engine:
    """Answers `info` with the torch thread count and the thread it ran on."""

    def info(self) -> tuple[int, str]:
        return torch.get_num_threads(), threading.current_thread().name


def test_engine_calls_run_on_the_client_workers_with_one_torch_thread() -> None:
    async def calls() -> list[tuple[int, str]]:
        drafter, verifier = InProcessDrafterClient(_Engine()), InProcessVerifierClient(_Engine())
        try:
            return list(await asyncio.gather(drafter.info(), verifier.info()))
        finally:
            await drafter.close()
            await verifier.close()

    before = torch.get_num_threads()
    (d_threads, d_name), (v_threads, v_name) = asyncio.run(calls())
    assert (d_threads, v_threads) == (1, 1)
    assert d_name.startswith("inprocess:drafter") and v_name.startswith("inprocess:verifier")
    assert torch.get_num_threads() == before  # the caller's thread keeps its setting

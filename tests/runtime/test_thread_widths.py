"""A verifier that shares the drafter's cores runs a pass on all its threads only when every call in
it said the drafter is idle (specdec.runtime.batching.ThreadWidths), and the orchestrator says so
only when no drafter call runs beside the pass (VerifyRequest.drafter_idle)."""

from __future__ import annotations

import torch

from specdec.runtime.batching import ForwardBatcher, ThreadWidths


def _threads_of_a_pass(batcher: ForwardBatcher) -> int:
    seen: list[int] = []
    batcher.alone(lambda: seen.append(torch.get_num_threads()))
    return seen[0]


def test_a_pass_is_wide_only_when_its_caller_says_the_drafter_is_idle():
    before = torch.get_num_threads()
    try:
        batcher = ForwardBatcher(model=None, threads=ThreadWidths(wide=2, beside_drafter=1))
        assert _threads_of_a_pass(batcher) == 1  # unsaid: beside the drafter
        with batcher.drafter_idle(True):
            assert _threads_of_a_pass(batcher) == 2
            with batcher.drafter_idle(False):
                assert _threads_of_a_pass(batcher) == 1
            assert _threads_of_a_pass(batcher) == 2
        assert _threads_of_a_pass(batcher) == 1
    finally:
        torch.set_num_threads(before)


def test_without_widths_the_thread_count_is_left_alone():
    before = torch.get_num_threads()
    batcher = ForwardBatcher(model=None)
    with batcher.drafter_idle(True):
        assert _threads_of_a_pass(batcher) == before

"""Engines under concurrent calls: passes are shared, and every call gets what it would alone.

Draft, Lookahead, Score and Verify calls from many sessions run in threads at once on batching
engines; the same requests on engines that run each pass alone (BatchConfig(enabled=False))
give the reference. Tokens must be equal and rows equal within float tolerance. Marked `device`:
on SPECDEC_TEST_DEVICE (cpu here, cuda on the GPU machine; tests/conftest.py).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch

from specdec.engine.api import DraftRequest, LookaheadRequest, ScoreRequest, VerifyRequest
from specdec.engine.drafter import DrafterEngine
from specdec.engine.verifier import VerifierEngine
from specdec.runtime.batch_config import BatchConfig
from specdec.sampling import SamplingParams
from specdec.verification.base import MethodParams

JOIN_S = 60
T1 = SamplingParams(temperature=1.0)
ALONE = BatchConfig(enabled=False)
SHARED = BatchConfig(window_ms=50)


def in_threads(calls: list[Callable[[], object]]) -> list[object]:
    """Run the calls at once (released together); results in order, or the first error raised."""
    results: list[object] = [None] * len(calls)
    errors: list[BaseException] = []
    start = threading.Barrier(len(calls))

    def run(index: int) -> None:
        try:
            start.wait(timeout=JOIN_S)
            results[index] = calls[index]()
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(JOIN_S)
    assert not any(thread.is_alive() for thread in threads), "a call hung"
    if errors:
        raise errors[0]
    return results


def prompts(n: int) -> list[list[int]]:
    return [[(3 * i + j) % 8 for j in range(1 + i % 5)] for i in range(n)]


@pytest.mark.device
def test_concurrent_drafts_and_lookaheads_equal_lone_ones(device_draft_model):
    def calls(engine: DrafterEngine) -> list[Callable[[], object]]:
        out: list[Callable[[], object]] = []
        for i, prompt in enumerate(prompts(8)):
            if i % 2:
                request = DraftRequest(f"d{i}", 0, prompt, [-1, 0, 1, -1][: 2 + i % 3], T1, seed=i,
                                       strategy="race" if i % 3 == 0 else "sample", want_distributions=True)
                out.append(lambda r=request: engine.draft(r))
            else:
                request = LookaheadRequest(f"l{i}", 0, prompt + [1, 2], k=2 + i % 2, sampling=T1, seed=i,
                                           want_distributions=True, bonus_guesses=2, rejection_guesses=1)
                out.append(lambda r=request: engine.lookahead(r))
        return out

    shared = DrafterEngine(device_draft_model, batching=SHARED)
    batched = in_threads(calls(shared))
    alone = [call() for call in calls(DrafterEngine(device_draft_model, batching=ALONE))]
    for got, want in zip(batched, alone, strict=True):
        drafts = [(b.token, b.draft) for b in got.branches] if hasattr(got, "branches") else [(None, got)]
        wanted = [(b.token, b.draft) for b in want.branches] if hasattr(want, "branches") else [(None, want)]
        for (token, draft), (want_token, want_draft) in zip(drafts, wanted, strict=True):
            assert token == want_token
            assert (draft.tokens, draft.parents) == (want_draft.tokens, want_draft.parents)
            torch.testing.assert_close(draft.draft_probs, want_draft.draft_probs, atol=1e-5, rtol=1e-4)
    stats = shared.stats()
    assert stats["batch_calls"] > stats["batches"], stats


@pytest.mark.device
def test_concurrent_scores_and_verifies_equal_lone_ones(device_target_model):
    """Several sessions: a Score for some, then every Verify, all at once; ERSD (no draft rows) over
    sequences and trees, greedy and seeded T = 1."""
    trees = [([1, 2, 3], [-1, 0, 1]), ([4], [-1]), ([5, 6, 7, 1], [-1, -1, 0, 2]), ([2, 2], [-1, 0])]

    def requests(i: int, prompt: list[int]) -> tuple[ScoreRequest, VerifyRequest]:
        tokens, parents = trees[i % len(trees)]
        sampling = SamplingParams(temperature=0.0 if i % 2 else 1.0)
        score = ScoreRequest(f"v{i}", 0, prompt, tokens, parents, sampling)
        verify = VerifyRequest(f"v{i}", 0, prompt, tokens, parents, "ersd",
                               MethodParams(seed=i), sampling)
        return score, verify

    def run(engine: VerifierEngine, concurrently: bool) -> list[object]:
        pairs = [requests(i, prompt) for i, prompt in enumerate(prompts(8))]
        scores = [lambda r=s: engine.score(r) for s, _ in pairs[::2]]
        verifies = [lambda r=v: engine.verify(r) for _, v in pairs]
        if concurrently:
            in_threads(scores)
            return in_threads(verifies)
        for call in scores:
            call()
        return [call() for call in verifies]

    shared = VerifierEngine(device_target_model, batching=SHARED)
    batched = run(shared, concurrently=True)
    alone = run(VerifierEngine(device_target_model, batching=ALONE), concurrently=False)
    for got, want in zip(batched, alone, strict=True):
        assert (got.tokens, got.accepted_nodes, got.committed_len) == (
            want.tokens, want.accepted_nodes, want.committed_len)
    stats = shared.stats()
    assert stats["batch_calls"] > stats["batches"], stats
    assert stats["queue_depth"] == 0

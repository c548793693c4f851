"""A served orchestrator's start-up warm-up (Orchestrator.warm_up, issue 37 item 5): one private request
through the real loop, so that the first user's request finds the pass and call times measured. It
keeps the timings and forgets the acceptance, no observer sees it, its suffix-cache partition goes
and its record is its own owner's; a warm-up that fails or runs too long is logged, not fatal."""

from __future__ import annotations

import logging
import math

import pytest

from orchestrator.clients.inprocess import InProcessDrafterClient, InProcessVerifierClient
from orchestrator.config import OrchestratorConfig
from orchestrator.speculation import WARM_UP_OWNER, Orchestrator
from specdec.generation import GenerationRequest

KEEPS_DRAFT_SOURCE_DEFAULT = True  # the warm-up is a request with no knobs: the hybrid, as users get


class _Observer:
    """A LoopObserver that records which requests it was shown (and observes nothing else)."""

    def __init__(self) -> None:
        self.started: list[str] = []

    def request_started(self, request_id, epoch, attributes):
        self.started.append(request_id)


def _orchestrator(engines, observer=None, **config) -> Orchestrator:
    return Orchestrator(InProcessDrafterClient(engines["draft"]),
                        InProcessVerifierClient(engines["verifier"]), OrchestratorConfig(**config),
                        observer=observer)


def _times_measured(orchestrator: Orchestrator) -> dict[str, bool]:
    pair = orchestrator._pair_estimates(orchestrator.config.default_method)
    return {"step": math.isfinite(orchestrator.source_estimates.iteration_seconds(1)),
            "model": any(math.isfinite(pair.iteration_seconds(k)) for k in range(1, 4)),
            "drafter calls": math.isfinite(orchestrator.link._call_times.pass_seconds(math.nan))}


async def test_the_warm_up_measures_times_and_forgets_acceptance(engines) -> None:
    orchestrator = _orchestrator(engines, warm_up_tokens=24)
    await orchestrator.start()
    assert not any(_times_measured(orchestrator).values())  # a fresh server: nothing measured
    result = await orchestrator.warm_up()
    assert result is not None and len(result.token_ids) == 24
    measured = _times_measured(orchestrator)
    assert measured["drafter calls"] and (measured["step"] or measured["model"]), measured
    pair = orchestrator._pair_estimates(orchestrator.config.default_method)
    assert pair._hits == [] and pair._drafted == {}  # what its drafts' acceptance taught is gone
    assert orchestrator.source_estimates._predicted == {} and orchestrator.source_estimates._accepted == {}
    assert len(orchestrator.suffix_caches) == 0  # its private suffix-cache partition is dropped
    record = await orchestrator.store.get_request(result.request_id, WARM_UP_OWNER)
    assert record is not None and record.status == "done"
    assert await orchestrator.store.get_request(result.request_id) is None  # no caller sees it
    await orchestrator.close()


async def test_no_observer_sees_the_warm_up_and_users_are_seen_as_before(engines) -> None:
    observer = _Observer()
    orchestrator = _orchestrator(engines, observer=observer, warm_up_tokens=8)
    await orchestrator.warm_up()
    assert observer.started == []
    await orchestrator.generate(GenerationRequest(prompt_ids=[1, 2, 3], max_new_tokens=4, request_id="user"))
    assert observer.started == ["user"]
    await orchestrator.close()


async def test_a_warm_up_that_fails_is_logged_and_serving_goes_on(engines, caplog) -> None:
    orchestrator = _orchestrator(engines, warm_up_tokens=0)
    assert await orchestrator.warm_up() is None  # 0 tokens: none
    with caplog.at_level(logging.WARNING, logger="orchestrator.speculation"):
        assert await orchestrator.warm_up(64, timeout_s=1e-4) is None  # past its time
    assert "warm-up request failed" in caplog.text
    result = await orchestrator.generate(GenerationRequest(prompt_ids=[1, 2, 3], max_new_tokens=4,
                                                           stop_token_ids=[]))
    assert len(result.token_ids) == 4
    await orchestrator.close()


@pytest.mark.parametrize("tokens", ["-1", "1025"])
def test_the_warm_up_length_is_checked(monkeypatch, tokens: str) -> None:
    monkeypatch.setenv("SPECDEC_WARM_UP_TOKENS", tokens)
    with pytest.raises(ValueError, match="warm_up_tokens"):
        OrchestratorConfig()

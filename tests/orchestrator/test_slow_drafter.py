"""A slow drafter (issue 14): each drafter call has a deadline, max(drafter_timeout_floor_s,
drafter_timeout_multiple × its expected time); past it the call is abandoned and the iteration falls
back to a target-only step — the request completes in bounded time with exact output (seeded: that of
a target-only run where every iteration fell back; greedy: the target's greedy). A late pipelined
look-ahead does not hold the verified block past its own deadline either. In-process engines."""

from __future__ import annotations

import asyncio
import time

import pytest

from orchestrator.adaptation import CATCH_UP_PER_PASS, DrafterCallTimes
from orchestrator.clients.inprocess import InProcessDrafterClient, InProcessVerifierClient
from orchestrator.config import OrchestratorConfig
from orchestrator.failover import drafter_deadline
from orchestrator.speculation import Orchestrator
from specdec.engine.drafter import DrafterEngine
from specdec.generation import GenerationRequest
from specdec.sampling import SamplingParams
from tests.orchestrator.helpers import slowed_model

pytestmark = pytest.mark.timeout(120)

FLOOR_S = 0.2
HANG_S = 60.0  # a call that would hang the request past the test's timeout without a deadline
GREEDY = SamplingParams(temperature=0.0)


class SlowDrafter(InProcessDrafterClient):
    """Sleeps HANG_S (cancellable) in the drafter calls `slow(op, number)` picks (0-based, draft and
    lookahead counted together); the others go to the engine."""

    def __init__(self, engine, slow) -> None:
        super().__init__(engine)
        self.slow = slow
        self.calls = 0
        self.abandoned = 0

    async def _maybe_hang(self, op: str) -> None:
        number = self.calls
        self.calls += 1
        if self.slow(op, number):
            try:
                await asyncio.sleep(HANG_S)
            except asyncio.CancelledError:
                self.abandoned += 1
                raise

    async def draft(self, request):
        await self._maybe_hang("draft")
        return await super().draft(request)

    async def lookahead(self, request):
        await self._maybe_hang("lookahead")
        return await super().lookahead(request)


def _config(**fields) -> OrchestratorConfig:
    return OrchestratorConfig(**{"pipeline": False, "adaptive_k": False, "drafter_timeout_floor_s": FLOOR_S,
                                 "drafter_timeout_multiple": 4.0, **fields})


def _request(n: int, seed: int = 11, sampling: SamplingParams | None = None, **knobs) -> GenerationRequest:
    return GenerationRequest(prompt_ids=[1, 2, 3], max_new_tokens=n, seed=seed, method="token", k=2,
                             stop_token_ids=[], sampling=sampling or SamplingParams(), **knobs)


async def _target_only(engines, request: GenerationRequest) -> list[int]:
    orch = Orchestrator(None, InProcessVerifierClient(engines["verifier"]), _config())
    return (await orch.generate(request)).token_ids


def test_the_deadline_is_a_bounded_multiple_of_the_measured_time():
    config = _config(drafter_timeout_floor_s=0.05)
    times = DrafterCallTimes()
    unmeasured = times.expected(2, 3, config.drafter_timeout_floor_s)
    assert unmeasured == pytest.approx(0.05 * (2 + 3 / CATCH_UP_PER_PASS))  # the floor per pass
    times.observe_verifier(1, 4, 0.04)  # the verifier's pass until the drafter has its own
    assert times.expected(2, 0, 1.0) == pytest.approx(0.08)
    for _ in range(20):
        times.observe(2, 3, 0.02)  # 10 ms per pass
        times.observe(2, 500, 5.0)  # a long catch-up teaches nothing about a pass
    assert times.expected(2, 0, 1.0) == pytest.approx(0.02)
    assert drafter_deadline(times.expected(2, 0, 1.0), config) == pytest.approx(0.08)  # 4 × expected
    assert drafter_deadline(times.expected(1, 0, 1.0), config) == pytest.approx(0.05)  # the floor
    # A prefill is given time by its length.
    assert drafter_deadline(times.expected(2, 800, 1.0), config) == pytest.approx(4 * 0.01 * (2 + 100))
    # Calls cut off at their deadline count as light samples of it: one stuck call moves the
    # expectation little, a drafter slower for everyone gets more time over many.
    before = times.expected(2, 0, 1.0)
    times.observe(2, 0, drafter_deadline(before, config), cut_off=True)
    assert before < times.expected(2, 0, 1.0) < 1.1 * before
    for _ in range(200):
        times.observe(2, 0, drafter_deadline(times.expected(2, 0, 1.0), config), cut_off=True)
    assert times.expected(2, 0, 1.0) > 3 * before


async def test_a_drafter_slow_from_the_start_is_abandoned(engines):
    """The first call hangs: abandoned after its deadline; with a long back-off the rest of the request
    runs target-only, and the seeded output is a target-only run's."""
    drafter = SlowDrafter(engines["draft"], lambda op, n: True)
    orch = Orchestrator(drafter, InProcessVerifierClient(engines["verifier"]),
                        _config(drafter_retry_seconds=30))
    start = time.monotonic()
    result = await orch.generate(_request(12))
    took = time.monotonic() - start
    # Nothing measured yet: the floor stands for a pass, 4 × 0.2 × (2 passes + 3/8 of a catch-up).
    assert took < 4 * FLOOR_S * (2 + 3 / CATCH_UP_PER_PASS) + 3.0, took
    assert drafter.abandoned == 1 and drafter.calls == 1
    assert result.stats.fallback_iterations == result.stats.iterations == 12
    assert result.token_ids == await _target_only(engines, _request(12))
    assert orch.dependency_status()["drafter_timeouts"] == 1
    assert orch.dependency_status()["drafter"]["state"] == "ok"  # late is not down: health is unaffected


async def test_a_drafter_that_turns_slow_costs_each_iteration_at_most_its_deadline(engines, loaded):
    """Fast for 4 calls (measured), then hanging: each later attempt is abandoned after
    max(floor, 4 × measured) and that iteration falls back; greedy output is the target's."""
    drafter = SlowDrafter(engines["draft"], lambda op, n: n >= 4)
    orch = Orchestrator(drafter, InProcessVerifierClient(engines["verifier"]),
                        _config(drafter_retry_seconds=0.0))
    start = time.monotonic()
    result = await orch.generate(_request(16, sampling=GREEDY))
    took = time.monotonic() - start
    fallbacks = result.stats.fallback_iterations
    assert fallbacks == drafter.abandoned > 0
    assert result.stats.drafted_iterations > 0
    assert took < fallbacks * 4 * FLOOR_S + 3.0, (took, fallbacks)  # deadlines near the floor here
    assert result.token_ids == await _target_only(engines, _request(16, sampling=GREEDY))
    assert orch.dependency_status()["drafter_timeouts"] == fallbacks


async def test_a_late_look_ahead_does_not_hold_the_verified_block(engines):
    """Pipelined: drafts answer, every look-ahead hangs. Each is abandoned at its deadline, the block
    the verifier checked meanwhile is kept (no fallback), the next block is drafted afresh."""
    drafter = SlowDrafter(engines["draft"], lambda op, n: op == "lookahead")
    orch = Orchestrator(drafter, InProcessVerifierClient(engines["verifier"]),
                        _config(pipeline=True, drafter_retry_seconds=0.0))
    start = time.monotonic()
    result = await orch.generate(_request(12, sampling=GREEDY, pipeline=True))
    took = time.monotonic() - start
    assert drafter.abandoned > 0 and result.stats.pre_drafts_used == 0
    assert took < drafter.abandoned * 4 * FLOOR_S + 3.0, (took, drafter.abandoned)
    assert result.token_ids == await _target_only(engines, _request(12, sampling=GREEDY))


async def test_an_abandoned_call_moves_the_run_to_a_fresh_drafter_session(model_dirs, engines):
    """A real engine blocked in its forward pass (a thread cannot be cancelled) finishes the abandoned
    call after the run moved on: the run drafts in a new session and releases both at its end."""
    slow = {"on": False}
    loaded = slowed_model(model_dirs["draft"], 0.0)
    loaded.model.register_forward_pre_hook(lambda module, args: time.sleep(0.6) if slow["on"] else None)
    engine = DrafterEngine(loaded)

    def switch(record) -> None:
        slow["on"] = record.index == 1  # only the drafter calls of the third iteration are slow

    orch = Orchestrator(InProcessDrafterClient(engine), InProcessVerifierClient(engines["verifier"]),
                        _config(drafter_retry_seconds=0.0), on_iteration=switch)
    result = await orch.generate(_request(12, sampling=GREEDY))
    assert result.iterations[2].fallback and result.stats.drafted_iterations >= 3
    assert result.token_ids == await _target_only(engines, _request(12, sampling=GREEDY))
    for _ in range(50):  # bounded: the abandoned call ends within its 0.6 s pass
        if engine.sessions.active_sessions == 0:
            break
        await asyncio.sleep(0.05)
    assert engine.sessions.active_sessions == 0  # the retired session was released too

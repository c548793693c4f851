"""A pass sent while the run's abandoned look-ahead is still in its drafter call runs at the drafter-
shared width: its time is the price of leaving the look-ahead, not a sample of a pass alone. Counted
as W(0), the k = 0 a draft length explores right after drafting read as slow as the look-ahead (2
vCPUs: 124–170 ms against 94 ms alone, bench/RESULTS.md "Steps beside an abandoned look-ahead"),
and requests drafted on where steps alone were faster."""

from __future__ import annotations

import asyncio
import math
from types import SimpleNamespace

from orchestrator.adaptation import PairEstimates, SourceEstimates
from orchestrator.config import OrchestratorConfig
from orchestrator.drafting import DraftingContext, proposer_for
from orchestrator.drafting.base import verify_draft
from orchestrator.drafting.hybrid import HybridChooser
from orchestrator.drafting.model import ModelProposer
from orchestrator.sessions import RunSessions
from tests.orchestrator.helpers import make_run

ALONE_S, BESIDE_S = 0.094, 0.165


async def test_the_run_knows_while_its_abandoned_drafter_call_runs() -> None:
    sessions = RunSessions(make_run(), None, None)  # type: ignore[arg-type]
    assert not sessions.abandoned_call_running()
    release = asyncio.Event()
    task = asyncio.create_task(release.wait())
    sessions.defer(task)
    assert sessions.abandoned_call_running()
    release.set()
    await task
    assert not sessions.abandoned_call_running()


class _Sessions:
    def __init__(self, abandoned: bool) -> None:
        self.abandoned, self.sent_idle = abandoned, None

    def drafter_idle(self) -> bool:
        return not self.abandoned

    def abandoned_call_running(self) -> bool:
        return self.abandoned

    async def verify(self, committed, tree, **kwargs):
        self.sent_idle = kwargs["drafter_idle"]
        return "outcome"


async def test_a_pass_beside_the_abandoned_call_is_marked_and_sent_at_the_shared_width() -> None:
    draft = SimpleNamespace(tree=(), method="token", params=None, rows=None, deterministic=False,
                            target_only=False)
    for abandoned, own_look_ahead, marked, idle in ((True, False, True, False), (False, False, False, True),
                                                    (True, True, False, False)):
        sessions = _Sessions(abandoned)
        step = SimpleNamespace(sessions=sessions, committed=[1, 2], timeline=None, beside_abandoned=None,
                               score_ahead=False,
                               run=SimpleNamespace(state=SimpleNamespace(text_cursor=None)))
        assert await verify_draft(step, draft, beside_drafter=own_look_ahead) == "outcome"  # type: ignore[arg-type]
        assert step.beside_abandoned is marked and sessions.sent_idle is idle


def _target_only_iteration(beside_abandoned: bool, seconds: float):
    timeline = SimpleNamespace(verify_seconds=lambda: seconds, draft_seconds=lambda: 0.0)
    step = SimpleNamespace(turn="", predicted=0.0, steady=True, drafter_steady=True, timeline=timeline,
                           beside_abandoned=beside_abandoned, counts=SimpleNamespace(),
                           run=SimpleNamespace(finished=False))
    draft = SimpleNamespace(target_only=True, fallback=False, source="", plan=None)
    record = SimpleNamespace(emitted=[1], accepted=0, num_drafted=0, start=0.0, end=seconds)
    outcome = SimpleNamespace(pass_calls=1, pass_rows=1)
    return step, draft, outcome, record


def test_the_hybrids_step_alone_is_not_measured_beside_the_abandoned_call() -> None:
    estimates = SourceEstimates()
    for _ in range(5):
        estimates.observe(None, predicted=0.0, accepted=0, positions=1, wall_seconds=ALONE_S)
    hybrid = HybridChooser([], None, estimates, timed=True)
    for _ in range(20):
        hybrid.settle(*_target_only_iteration(True, BESIDE_S))  # type: ignore[arg-type]
    assert math.isclose(estimates.iteration_seconds(1), ALONE_S, rel_tol=1e-9)
    for _ in range(20):  # the same steps with the drafter idle are steps alone: they count
        hybrid.settle(*_target_only_iteration(False, BESIDE_S))  # type: ignore[arg-type]
    assert estimates.iteration_seconds(1) > ALONE_S + 0.5 * (BESIDE_S - ALONE_S)


def test_the_pairs_w0_is_not_measured_beside_the_abandoned_call() -> None:
    config = OrchestratorConfig(pipeline=True)
    pair = PairEstimates()
    proposer = proposer_for(make_run(config=config, seed=None), DraftingContext(config, lambda: pair))
    assert isinstance(proposer, ModelProposer) and proposer.shape.adaptive

    def weights() -> float:
        return sum(pair.weight(k) for k in range(config.max_k + 1))

    for _ in range(6):
        proposer.settle(*_target_only_iteration(True, BESIDE_S))  # type: ignore[arg-type]
    assert weights() == 0.0
    for _ in range(6):
        proposer.settle(*_target_only_iteration(False, ALONE_S))  # type: ignore[arg-type]
    assert weights() > 0.0

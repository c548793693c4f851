"""Model-free drafts grow with cheap passes: the hybrid's node cap follows the measured pass time W(n)
(SourceEstimates.node_cap, docs/algorithms.md §15 "How long a model-free draft"), so a CPU or GPU
whose wide passes cost little drafts longer than the configured caps, and one whose rows are dear
keeps them; a draft rejected whole never costs more than DRAFT_COST_STEPS target-only steps."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from orchestrator.adaptation import DRAFT_COST_STEPS, SourceEstimates
from orchestrator.drafting.hybrid import HybridChooser
from orchestrator.drafting.model_free import SuffixProposer
from specdec.model_free import SuffixCache


def _measured(step_s: float, per_row_s: float, sizes: tuple[int, ...] = (1, 5, 9)) -> SourceEstimates:
    """Target-only steps and model-free drafts whose pass costs step_s + per_row_s · (rows − 1)."""
    estimates = SourceEstimates()
    for rows in sizes:
        for _ in range(4):
            estimates.observe(None, predicted=0.0, accepted=0, positions=rows,
                              wall_seconds=step_s + per_row_s * (rows - 1))
    return estimates


@pytest.mark.parametrize(("step_ms", "per_row_ms", "expected"), [
    (66.0, 2.6, 25),  # a VNNI EPYC's 1.5B target: W(26) = 66 + 25·2.6 ≤ 132 ms < W(27)
    (66.0, 0.5, 64),  # cheap wide passes (AMX, a GPU): the ceiling
    (60.0, 20.0, 16),  # dear rows (an AVX2 CPU): W(17) is past two steps, the configured cap stays
])
def test_the_cap_is_the_longest_draft_whose_pass_costs_at_most_two_steps(step_ms: float, per_row_ms: float,
                                                                         expected: int) -> None:
    estimates = _measured(step_ms / 1e3, per_row_ms / 1e3)
    cap = estimates.node_cap(16, 64)
    assert cap == expected
    budget = DRAFT_COST_STEPS * estimates.iteration_seconds(1)
    if cap > 16:  # raised: within the budget, and one node more would not be (or the ceiling binds)
        assert estimates.iteration_seconds(cap + 1) <= budget
        assert cap == 64 or estimates.iteration_seconds(cap + 2) > budget


def test_the_configured_cap_stays_until_two_pass_sizes_were_measured_or_with_no_ceiling() -> None:
    assert SourceEstimates().node_cap(10, 64) == 10
    assert _measured(0.066, 0.0005, sizes=(1,)).node_cap(10, 64) == 10  # the slope would be a prior
    flat = _measured(0.066, 0.0005)
    assert flat.node_cap(10, 64) == 64
    assert flat.node_cap(10, 0) == 10  # model_free_max_nodes = 0: the caps stay
    assert flat.node_cap(10, 8) == 10  # a ceiling below the cap never lowers it


def _step(committed: list[int]) -> SimpleNamespace:
    sessions = SimpleNamespace(lag=lambda committed, drafting: 0)
    run = SimpleNamespace(streamed=False, state=SimpleNamespace(generated=[]))
    return SimpleNamespace(committed=committed, position=len(committed), depth_cap=lambda position: 1 << 30,
                           sessions=sessions, params=lambda: None, turn="", predicted=0.0, steady=True,
                           proposal=None, run=run)


def _planned_nodes(estimates: SourceEstimates, *, timed: bool) -> int:
    """Nodes of the hybrid's plan after a prompt that repeats a 60-token text (a long copy)."""
    text = list(range(100, 160))
    prompt = [*text, 7, *text[:40]]  # the copy has begun: 40 tokens of the text again
    cache = SuffixCache(max_requests=0, max_tokens=0)
    proposer = SuffixProposer(cache, "r", prompt, max_nodes=16)
    hybrid = HybridChooser([proposer], None, estimates, timed=timed, max_nodes=64)
    plan = hybrid.plan(_step(prompt))
    assert plan is not None
    return plan.k


def test_a_long_copy_drafts_past_the_cap_where_passes_are_cheap_and_not_where_rows_are_dear() -> None:
    assert _planned_nodes(_measured(0.066, 0.0005), timed=True) > 16  # fails with a fixed cap of 16
    assert _planned_nodes(_measured(0.060, 0.020), timed=True) <= 16
    # A seeded request reads no timings (its replay must not depend on the machine): the cap stays.
    assert _planned_nodes(_measured(0.066, 0.0005), timed=False) <= 16

"""Fresh drafts from the draft model: a sequence of k tokens (k fixed, or picked online) and a tree
within a node budget (docs/algorithms.md §6 for the tree's shape, §8 for why any k or shape is exact).
"""

from __future__ import annotations

import math
from collections.abc import Callable

from orchestrator.adaptation import STEADY_CATCH_UP, DraftLength, Observation, PairEstimates
from orchestrator.drafting.base import Draft, Drafting, Plan, Step
from orchestrator.run import RunSettings
from orchestrator.scheduling import cap_depth
from specdec.engine.api import DraftResult, VerifyOutcome
from specdec.trees import DraftTree, optimal_tree_shape, sequence_parents


async def propose(step: Step, plan: Plan, *, park_rows: bool = False) -> DraftResult:
    """The drafter's tree of the plan's shape after the committed prefix. `park_rows`: the rows stay
    at the drafter where the method's rows go lean (orchestrator.sessions.ParkedRows); a strategy
    that reads the rows itself (RD's coins) leaves it off."""
    return await step.sessions.draft(step.committed, shape=plan.shape, timeline=step.timeline,
                                     park_rows=park_rows)


def as_draft(step: Step, plan: Plan, result: DraftResult) -> Draft:
    """A drafter's answer as the draft the run's method verifies."""
    tree = DraftTree(tuple(result.tokens), tuple(result.parents))
    rows = step.sessions.parked(result) or result.draft_probs
    return Draft(tree, rows, step.settings.method, plan.params, plan=plan)


class SequenceDrafts(Drafting):
    """k tokens in a row. An adaptive run re-picks k before every iteration from its own acceptance
    and the pair's timings (orchestrator.adaptation), and every run of a sequence method teaches the
    pair's estimates."""

    def __init__(self, settings: RunSettings, *, estimates: Callable[[], PairEstimates],
                 chooser: DraftLength | None = None) -> None:
        self.k = settings.k  # the draft length of the coming iteration
        self.adaptive = chooser is not None
        self._estimates = estimates
        self._chooser = chooser
        self._steady = True  # the iteration's engines took in at most STEADY_CATCH_UP tokens first

    def plan(self, step: Step) -> Plan | None:
        if self._chooser is not None:
            self.k = self._chooser.choose()
        length = min(self.k, step.depth_cap(step.position))
        plan = Plan(sequence_parents(length), self.k, step.params()) if length > 0 else None
        self._steady = step.sessions.lag(step.committed, drafting=plan is not None) <= STEADY_CATCH_UP
        return plan

    async def draft(self, step: Step, plan: Plan, ready: DraftResult | None = None) -> Draft:
        """The plan's draft: `ready` when a look-ahead pre-drafted it, else a fresh one."""
        step.record.k = plan.k
        return as_draft(step, plan, ready if ready is not None else await propose(step, plan, park_rows=True))

    def expected_rate(self) -> float:
        """The online chooser's tokens per second at its best length (nan for a fixed k)."""
        if self._chooser is None:
            return math.nan
        return self._chooser.tokens_per_second(self._chooser.best())

    def full_block(self, plan: Plan) -> bool:
        """Every sequence iteration drafts a full block: it can be pre-drafted (lookahead)."""
        return True

    def next_length(self, step: Step, position: int) -> int:
        """The block the iteration starting at `position` would draft (0: none)."""
        return min(self.k, step.depth_cap(position))

    def settle(self, step: Step, draft: Draft, outcome: VerifyOutcome) -> None:
        """Teach the pair's estimates (and an adaptive run's own chooser) what the iteration cost and
        yielded. A step forced by a lost drafter, or a target-only step the run did not choose, says
        nothing of speculation; times after a prefill (not steady) are not a sample of W(k)."""
        if draft.fallback or (draft.target_only and not self.adaptive):
            return
        record, timeline = step.record, step.timeline
        observation = Observation(
            drafted=record.num_drafted, accepted=record.accepted, wall_seconds=record.end - record.start,
            verify_seconds=timeline.verify_seconds(), draft_seconds=timeline.draft_seconds(),
            steady=self._steady, setting=self.k if self.adaptive else None,
            switched=self._chooser is not None and self._chooser.switched,
        )
        self._estimates().observe(observation)
        if self._chooser is not None:
            self._chooser.observe(observation)


class TreeDrafts(Drafting):
    """A tree within the run's node budget, shaped from the pair's rank acceptance (§6) and cut to
    the depth that fits the context windows."""

    def __init__(self, settings: RunSettings) -> None:
        assert settings.tree_budget is not None
        self.budget = settings.tree_budget
        self.shape = optimal_tree_shape(list(settings.rank_acceptance), settings.tree_budget)

    def plan(self, step: Step) -> Plan | None:
        cap = step.depth_cap(step.position)
        if cap <= 0:
            return None
        return Plan(cap_depth(self.shape, cap), self.budget, step.params())

    async def draft(self, step: Step, plan: Plan) -> Draft:
        step.record.k = plan.k
        return as_draft(step, plan, await propose(step, plan, park_rows=True))


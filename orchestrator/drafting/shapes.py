"""How a method shapes the draft model's drafts (Method.drafting): a sequence of k tokens (k fixed, or
picked online), a tree within a node budget, RD's coins, or none. Where the tokens come from is the
model proposer's (orchestrator.drafting.model: its drafter calls and look-ahead); a shape plans and
turns a drafter's answer into the draft its method verifies (docs/algorithms.md §5 for the coins,
§6 for the tree's shape, §8 for why any k or shape is exact).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol

import torch

from orchestrator.adaptation import STEADY_CATCH_UP, DraftLength, Observation, PairEstimates
from orchestrator.drafting.base import Draft, Plan, Step
from orchestrator.failover import both
from orchestrator.run import RunSettings
from orchestrator.scheduling import cap_depth, rd_leading_heads
from orchestrator.sessions import draft_rows
from specdec.engine.api import DraftResult, VerifyOutcome
from specdec.generation import IterationRecord
from specdec.trees import DraftTree, optimal_tree_shape, sequence_parents
from specdec.verification.base import MethodParams


class Shape(Protocol):
    """How a method shapes the draft model's drafts; the model proposer calls it (and pre-drafts the
    blocks of a shape whose full_block says so)."""

    rejection_guesses: bool  # whether a look-ahead's guesses may assume the last draft token rejected

    def plan(self, step: Step) -> Plan | None:
        """What to draft at this prefix; None for a target-only step."""
        ...

    async def draft(self, step: Step, plan: Plan, ready: DraftResult | None = None) -> Draft:
        """The plan's draft: `ready` when a look-ahead pre-drafted it, else from a drafter call."""
        ...

    def full_block(self, plan: Plan) -> bool:
        """Whether the plan's block is one a pre-draft can stand in for."""
        ...

    def next_length(self, step: Step, position: int) -> int:
        """The block the iteration starting at `position` would draft (0: none a pre-draft could fill)."""
        ...

    def settle(self, step: Step, draft: Draft, outcome: VerifyOutcome, record: IterationRecord) -> None:
        """Learn from the iteration (the shape's own estimates)."""
        ...

    def expected_rate(self) -> float:
        """Expected tokens per second at the shape's best choice (nan: it keeps no estimate)."""
        ...


class ShapeBase:
    """The defaults: no pre-drafts, no learning, no estimate."""

    rejection_guesses = True  # a look-ahead may guess the last draft token rejected (drafting.model)

    def full_block(self, plan: Plan) -> bool:
        return False

    def next_length(self, step: Step, position: int) -> int:
        return 0

    def settle(self, step: Step, draft: Draft, outcome: VerifyOutcome, record: IterationRecord) -> None:
        return None

    def expected_rate(self) -> float:
        return math.nan


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


class SequenceDrafts(ShapeBase):
    """k tokens in a row. An adaptive run re-picks k before every iteration from its own acceptance
    and the pair's timings (orchestrator.adaptation), and every run of a sequence method teaches the
    pair's estimates."""

    def __init__(self, settings: RunSettings, *, estimates: Callable[[], PairEstimates],
                 chooser: DraftLength | None = None) -> None:
        self.k = settings.k  # the draft length of the coming iteration
        self.adaptive = chooser is not None
        self._estimates = estimates
        self._chooser = chooser

    def plan(self, step: Step) -> Plan | None:
        if self._chooser is not None:
            self.k = self._chooser.choose()
        length = min(self.k, step.depth_cap(step.position))
        plan = Plan(sequence_parents(length), self.k, step.params()) if length > 0 else None
        step.drafter_steady = step.sessions.lag(step.committed, drafting=plan is not None) <= STEADY_CATCH_UP
        return plan

    async def draft(self, step: Step, plan: Plan, ready: DraftResult | None = None) -> Draft:
        """The plan's draft: `ready` when a look-ahead pre-drafted it, else a fresh one."""
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

    def settle(self, step: Step, draft: Draft, outcome: VerifyOutcome, record: IterationRecord) -> None:
        """Teach the pair's estimates (and an adaptive run's own chooser) what the iteration cost and
        yielded. A step forced by a lost drafter, or a target-only step the run did not choose, says
        nothing of speculation; times after a prefill (not steady), and a target-only step's beside the
        run's abandoned look-ahead (the pass at the drafter-shared width: a switch's cost, not W(0)),
        are not a sample of W(k)."""
        if draft.fallback or (draft.target_only and not self.adaptive):
            return
        timeline = step.timeline
        observation = Observation(
            drafted=record.num_drafted, accepted=record.accepted, wall_seconds=record.end - record.start,
            verify_seconds=timeline.verify_seconds(), draft_seconds=timeline.draft_seconds(),
            steady=step.drafter_steady and not (draft.target_only and step.beside_abandoned),
            setting=self.k if self.adaptive else None,
            switched=self._chooser is not None and self._chooser.switched,
        )
        self._estimates().observe(observation)
        if self._chooser is not None:
            self._chooser.observe(observation)


class TreeDrafts(ShapeBase):
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

    async def draft(self, step: Step, plan: Plan, ready: DraftResult | None = None) -> Draft:
        return as_draft(step, plan, await propose(step, plan, park_rows=True))


class CoinDrafts(ShapeBase):
    """Randomised drafting (RD, docs/algorithms.md §5): per-position Bernoulli(a) coins fix how many
    tokens an iteration drafts, K ≤ k_max; on tails the drafter's row at position K + 1 is computed
    while the target scores the draft, so both models run at once. The coins of the iteration's
    position give K; the drafter drafts K tokens."""

    # RD looks ahead only where its next coins give a full block, known for the bonus guess alone.
    rejection_guesses = False

    def __init__(self, settings: RunSettings) -> None:
        assert settings.a is not None
        self.a = settings.a
        self.k = settings.k  # k_max before the context windows cap it

    def plan(self, step: Step) -> Plan | None:
        k_max = min(self.k, step.depth_cap(step.position))
        if k_max <= 0:
            return None
        seed, position = step.settings.seed, step.position
        heads = rd_leading_heads(self.a, k_max, seed, position)
        params = MethodParams(a=self.a, k_max=k_max, seed=seed, position=position)
        return Plan(sequence_parents(heads), self.k, params)

    def full_block(self, plan: Plan) -> bool:
        """Only a block of K = k_max tokens can be pre-drafted: no tails position to fill."""
        return len(plan.shape) == plan.params.k_max

    def next_length(self, step: Step, position: int) -> int:
        """k_max at `position` when that iteration's coins give a full block, else 0: a pre-draft
        of any other length would not be used."""
        k_max = min(self.k, step.depth_cap(position))
        if k_max <= 0 or rd_leading_heads(self.a, k_max, step.settings.seed, position) != k_max:
            return 0
        return k_max

    async def draft(self, step: Step, plan: Plan, ready: DraftResult | None = None) -> Draft:
        """The K drafted tokens with Q_1..Q_K, and, when position K + 1 had tails (K < k_max),
        Q_{K+1} from a drafter pass that runs while the target scores the draft (for K = 0 that pass
        is the iteration's only drafter call)."""
        heads, k_max = len(plan.shape), plan.params.k_max
        tree, rows = DraftTree.empty(), None
        if heads > 0:
            result = ready if ready is not None else await propose(step, plan)
            tree = DraftTree(tuple(result.tokens), tuple(result.parents))
            if len(tree) != heads:
                raise RuntimeError(f"drafter returned {len(tree)} tokens for an RD sequence of {heads}")
            rows = draft_rows(result, heads + 1)
        if heads < k_max:
            sessions, committed, timeline = step.sessions, step.committed, step.timeline
            extra, _ = await both(sessions.draft(committed + list(tree.tokens), shape=[], timeline=timeline),
                                  sessions.score(committed, tree, timeline=timeline))
            last = draft_rows(extra, 1)
            rows = last if rows is None else torch.cat([rows[:heads], last.to(rows.dtype)])
        assert rows is not None
        return Draft(tree, rows, step.settings.method, plan.params, plan=plan, heads=heads)


class NoDrafts(ShapeBase):
    """Target-only decoding (method "autoregressive"): never drafts."""

    def plan(self, step: Step) -> Plan | None:
        return None

    async def draft(self, step: Step, plan: Plan, ready: DraftResult | None = None) -> Draft:
        raise AssertionError("a target-only run plans no draft")

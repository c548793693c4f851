"""Randomised drafting (RD, docs/algorithms.md §5): per-position Bernoulli(a) coins fix how many
tokens an iteration drafts, K ≤ k_max; on tails the drafter's row at position K + 1 is computed
while the target scores the draft, so both models run at once."""

from __future__ import annotations

import torch

from orchestrator.drafting.base import Draft, Drafting, Plan, Step
from orchestrator.drafting.fresh import propose
from orchestrator.failover import both
from orchestrator.run import RunSettings
from orchestrator.scheduling import rd_leading_heads
from orchestrator.sessions import draft_rows
from specdec.engine.api import DraftResult
from specdec.trees import DraftTree, sequence_parents
from specdec.verification.base import MethodParams


class CoinDrafts(Drafting):
    """RD's drafts: the coins of the iteration's position give K, the drafter drafts K tokens."""

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
        step.record.k, step.record.heads = plan.k, heads
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
        return Draft(tree, rows, step.settings.method, plan.params, plan=plan)

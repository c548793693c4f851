"""What every draft source shares: the iteration it works in (Step), what it plans and drafts (Plan,
Draft), the one Protocol the loop and the hybrid's chooser call (Proposer), and the target-only step.

A proposer decides what an iteration drafts and how; it never decides what is accepted. Every
choice it makes is fixed from the committed prefix and the drafter's own streams before the
target's pass reads the draft, which is why any proposer keeps the output's law
(docs/algorithms.md §8). It writes nothing of the run's state: what it adds to the run's statistics
goes in the iteration's Step.counts, which the loop takes in.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from orchestrator.run import Run, RunSettings
from orchestrator.sessions import ParkedRows, RunSessions
from orchestrator.timeline import Timeline
from specdec.defaults import DraftSource
from specdec.engine.api import VerifyOutcome
from specdec.generation import GenerationStats, IterationRecord
from specdec.methods import TARGET_ONLY_VERIFICATION
from specdec.model_free import Proposal
from specdec.trees import DraftTree
from specdec.verification.base import MethodParams


@dataclass
class Step:
    """One iteration: what a proposer reads (the run, its sessions, the committed prefix), and what it
    decides in plan() and reads back later in the same iteration. Those decisions live here, never on
    the long-lived proposer, so no flag outlives its iteration."""

    run: Run
    sessions: RunSessions
    committed: list[int]
    timeline: Timeline
    depth_cap: Callable[[int], int]  # the deepest draft that fits every context window at a position
    drafter_lost: Callable[[Exception], None]  # a lost drafter, reported to the engine link
    proposal: Proposal | None = None  # model-free: the proposal planned, not yet drafted
    turn: str = ""  # hybrid: the source whose plan this is ("": a target-only step without the model)
    predicted: float = 0.0  # hybrid: the chosen model-free proposal's expected accepted tokens
    steady: bool = True  # hybrid: the engines take in at most STEADY_CATCH_UP tokens before the pass
    drafter_steady: bool = True  # sequence drafts: the same, the drafter's catch-up included
    # The pass ran beside this run's abandoned look-ahead (its drafter call still running), so at the
    # drafter-shared width: what it cost is the look-ahead's, not a sample of a pass alone (W(n)).
    beside_abandoned: bool = False
    # The loop knows the next iteration is a target-only step too: the verifier may score it ahead
    # (VerifyRequest.score_ahead; Orchestrator._scores_ahead says when).
    score_ahead: bool = False
    counts: GenerationStats = field(default_factory=GenerationStats)  # pre-draft counts, for the loop

    @property
    def position(self) -> int:
        return len(self.committed)

    @property
    def settings(self) -> RunSettings:
        return self.run.settings

    def params(self) -> MethodParams:
        """The verification parameters every rule gets: the run's seed and the iteration's position."""
        return MethodParams(seed=self.settings.seed, position=self.position)


@dataclass(frozen=True)
class Plan:
    """What one iteration drafts, decided before any drafting."""

    shape: list[int]  # parent indices of the draft tree ([]: nothing drafted yet, e.g. RD with K = 0)
    k: int  # the size asked for (IterationRecord.k): draft length, RD k_max or tree budget
    params: MethodParams
    needs_drafter: bool = True  # False: drafted without the draft model (no drafter call)
    source: str = DraftSource.MODEL  # where the draft comes from (IterationRecord.source)
    pipelined: bool = False  # the next block is pre-drafted while this one is verified (lookahead)
    step_ahead: bool = False  # a target-only step while the drafter looks ahead (lookahead)


@dataclass(frozen=True)
class Draft:
    """What the target's pass verifies: a tree, its draft rows, and the rule that decides it."""

    tree: DraftTree
    rows: torch.Tensor | ParkedRows | None  # ParkedRows: the rows stay at the drafter (lean)
    method: str  # the verification rule (the run's method, or the target-only one)
    params: MethodParams
    plan: Plan | None = None  # None: a target-only step by plan, or one that replaced a lost draft
    target_only: bool = False
    fallback: bool = False  # target-only because the drafter was away or lost (IterationRecord.fallback)
    source: str = DraftSource.MODEL  # where the draft came from (IterationRecord.source)
    deterministic: bool = False  # model-free: q one-hot at every node, no rows (VerifyRequest.deterministic)
    heads: int | None = None  # RD: the leading heads K its coins gave (IterationRecord.heads)


class Proposer(Protocol):
    """One draft source, as the loop and the hybrid's chooser see it: the draft model, a model-free
    source, or a chooser over them (orchestrator.drafting.PROPOSERS builds one per run by name)."""

    source: str  # the DraftSource it drafts from (IterationRecord.source)

    def plan(self, step: Step) -> Plan | None:
        """What to draft at this prefix; None for a target-only step."""
        ...

    async def draft(self, step: Step, plan: Plan) -> Draft:
        """The plan's draft tree and rows (raises failover.DrafterDown when the drafter is lost)."""
        ...

    async def verify(self, step: Step, draft: Draft) -> VerifyOutcome:
        """One target pass over the draft (a proposer may work beside it: the look-ahead)."""
        ...

    def settle(self, step: Step, draft: Draft, outcome: VerifyOutcome, record: IterationRecord) -> None:
        """Learn from the iteration (its record, built by the loop): the proposer's own estimates only."""
        ...

    def expected_rate(self) -> float:
        """Expected tokens per second at the proposer's best choice (nan: it keeps no estimate); what
        a chooser compares against a target-only step."""
        ...

    def close(self, committed: list[int]) -> None:
        """The run ended (or stopped) with `committed`: hand over what outlives it (the suffix cache)."""
        ...


class ProposerBase:
    """The defaults: verify the draft in one target pass, learn nothing from it, keep no estimate."""

    source: str = DraftSource.MODEL

    async def verify(self, step: Step, draft: Draft) -> VerifyOutcome:
        return await verify_draft(step, draft)

    def settle(self, step: Step, draft: Draft, outcome: VerifyOutcome, record: IterationRecord) -> None:
        return None

    def close(self, committed: list[int]) -> None:
        return None

    def expected_rate(self) -> float:
        return math.nan


async def verify_draft(step: Step, draft: Draft, *, beside_drafter: bool = False) -> VerifyOutcome:
    """One target pass over committed + the draft tree with the draft's rule. `beside_drafter`: the
    strategy starts a drafter call beside it (a look-ahead), so the drafter is not idle even if no
    call runs yet when the pass is sent."""
    idle = not beside_drafter and step.sessions.drafter_idle()
    step.beside_abandoned = not beside_drafter and step.sessions.abandoned_call_running()
    return await step.sessions.verify(step.committed, draft.tree, method=draft.method, params=draft.params,
                                      draft_probs=draft.rows, timeline=step.timeline,
                                      text=step.run.state.text_cursor, deterministic=draft.deterministic,
                                      drafter_idle=idle, score_ahead=step.score_ahead and draft.target_only)


def target_only_draft(step: Step, *, plan: Plan | None = None, fallback: bool = False) -> Draft:
    """A target-only step: one token from the target alone, by race sampling keyed on (seed,
    position), so a seeded ERSD run and a seeded target-only run emit the same token
    (docs/algorithms.md §4). A step beside a look-ahead keeps the k its plan asked for."""
    return Draft(DraftTree.empty(), None, TARGET_ONLY_VERIFICATION, step.params(), plan=plan,
                 target_only=True, fallback=fallback)

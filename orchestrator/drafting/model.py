"""The draft model as a proposer: its drafter calls, shaped by the run's method (orchestrator.drafting.
shapes), and its look-ahead: while the verifier checks one block, the drafter pre-drafts the next.

One drafter `lookahead` call guesses what the verifier will commit (bonus guesses: all accepted
plus a likely next token; rejection guesses: the last draft replaced) and drafts a block after each
guess; the block whose guess came true is the next iteration's draft. Variants, all owned here:
growing pre-drafts (`pipeline_max_k`: the first bonus guess's block grows until the verifier
answers) and pre-drafted only (an adaptive run verifies only pre-drafted blocks; otherwise it takes
a target-only step while the drafter looks ahead). Why each keeps the output's law:
docs/algorithms.md §8, "Pipelining / look-ahead pre-drafts", "Pre-drafted only", "Adaptive draft
length".
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, replace

import torch

from orchestrator.accounting import bump_at
from orchestrator.drafting.base import Draft, Plan, ProposerBase, Step, target_only_draft, verify_draft
from orchestrator.drafting.shapes import Shape
from orchestrator.failover import DrafterDown
from orchestrator.run import RunSettings
from orchestrator.sessions import draft_rows
from specdec.defaults import DraftSource
from specdec.engine.api import DraftResult, VerifyOutcome
from specdec.generation import IterationRecord
from specdec.trees import DraftTree, sequence_parents

log = logging.getLogger(__name__)


@dataclass
class PreDraft:
    """A block drafted ahead from a guessed context."""

    context: list[int]  # the committed sequence it assumes: c + x + b, or c + x_1..x_{k-1} + r
    draft: DraftResult
    rejection: bool = False  # assumes x_k rejected (r emitted) rather than all accepted
    rank: int = 0  # rank of its guess among the guesses of its kind


class ModelProposer(ProposerBase):
    """The draft model's drafts in the run's method's shape; pre-drafted around the shape's full blocks
    when the run pipelines (module docstring)."""

    source = DraftSource.MODEL

    def __init__(self, shape: Shape, settings: RunSettings, *, pipelined: bool, predrafted_only: bool,
                 rejection_guesses: bool = True) -> None:
        self.shape = shape
        self.settings = settings
        self.pipelined = pipelined
        self.growing = pipelined and settings.pipeline_max_k > 0 and settings.spec.adaptive_length
        self.predrafted_only = pipelined and predrafted_only and settings.adaptive and not self.growing
        self.rejection_guesses = settings.rejection_guesses if rejection_guesses else 0
        self.predraft: PreDraft | None = None  # the next block, drafted while the last one was verified

    # the iteration ---------------------------------------------------------------------------------
    def plan(self, step: Step) -> Plan | None:
        plan = self.shape.plan(step)
        if not self.pipelined or plan is None or not self.shape.full_block(plan):
            return plan
        if self.predrafted_only and not self.has_predraft(step.committed, len(plan.shape)):
            return replace(plan, step_ahead=True)
        return replace(plan, pipelined=True)

    async def draft(self, step: Step, plan: Plan) -> Draft:
        if plan.step_ahead:
            self.drop(step)  # a pre-draft of another prefix or length
            return target_only_draft(step, plan=plan)
        ready = self.take(step, len(plan.shape)) if plan.pipelined else None
        return await self.shape.draft(step, plan, ready)

    async def verify(self, step: Step, draft: Draft) -> VerifyOutcome:
        plan = draft.plan
        next_k = 0
        if plan is not None and (plan.pipelined or plan.step_ahead):
            asked = 0 if plan.step_ahead else len(plan.shape)  # a step beside a look-ahead drafted nothing
            next_k = self.next_block(step, draft.tree, asked)
        verify = verify_draft(step, draft, beside_drafter=next_k > 0)
        return await self.verify_and_look_ahead(step, draft, verify, next_k=next_k)

    def settle(self, step: Step, draft: Draft, outcome: VerifyOutcome, record: IterationRecord) -> None:
        looked_ahead = draft.plan is not None and draft.plan.step_ahead
        if step.run.finished or (draft.target_only and not looked_ahead):
            self.drop(step)  # the run ended, or a target-only step took the block's place
        self.shape.settle(step, draft, outcome, record)

    def expected_rate(self) -> float:
        return self.shape.expected_rate()

    # pre-drafts ----------------------------------------------------------------------------------
    def has_predraft(self, committed: list[int], k: int) -> bool:
        """Whether take(committed, k) returns a block: one whose context came true and whose length
        fits (k, or any up to the cap when growing)."""
        predraft = self.predraft
        if predraft is None or predraft.context != committed:
            return False
        length = len(predraft.draft.tokens)
        return 0 < length <= self.settings.pipeline_max_k if self.growing else length == k

    def take(self, step: Step, k: int) -> DraftResult | None:
        """The pre-drafted block for the step's prefix, if its context came true (any length when
        growing); counted in the step's counts."""
        if not self.has_predraft(step.committed, k):
            self.drop(step)
            return None
        predraft, self.predraft = self.predraft, None
        assert predraft is not None
        counts = step.counts
        counts.pre_drafts_used += 1
        bump_at(counts.pre_draft_rejection_hits if predraft.rejection else counts.pre_draft_bonus_hits,
                predraft.rank)
        return predraft.draft

    def drop(self, step: Step) -> None:
        if self.predraft is not None:
            self.predraft = None
            step.counts.pre_drafts_dropped += 1

    def next_block(self, step: Step, tree: DraftTree, k: int) -> int:
        """Length of the block to pre-draft for the context c + x + b, or 0 when not worth it: the
        drafter stopped short, full acceptance would end the request (length, or a stop token among
        the drafts), or the inner strategy would not use a pre-draft there (RD's coins)."""
        settings, generated = self.settings, len(step.run.state.generated)
        if len(tree) != k or any(t in settings.stop_ids for t in tree.tokens):
            return 0
        if generated + len(tree) + 1 >= settings.max_new_tokens:
            return 0
        position = step.position + len(tree) + 1
        next_k = self.shape.next_length(step, position)
        if self.growing:  # the cap of a growing pre-draft
            left = settings.max_new_tokens - generated - len(tree) - 1
            next_k = min(settings.pipeline_max_k, step.depth_cap(position), left)
        return max(next_k, 0)

    def bonus_guesses(self, k: int) -> int:
        """The run's setting, or automatic: 2 for one-token blocks, 1 for longer ones."""
        if self.settings.bonus_guesses is not None:
            return self.settings.bonus_guesses
        return 2 if k == 1 else 1

    async def verify_and_look_ahead(
        self, step: Step, draft: Draft, verify: Awaitable[VerifyOutcome], *, next_k: int
    ) -> VerifyOutcome:
        """Await `verify` (block n = the draft after the committed prefix) while pre-drafting block
        n+1 of next_k tokens; keeps the block whose guess came true, if any (next_k = 0: just verify)."""
        if not next_k:
            return await verify
        sessions, committed, tree = step.sessions, step.committed, draft.tree
        abandon, answered = asyncio.Event(), asyncio.Event()
        rejections = self.rejection_guesses if len(tree) else 0  # a target-only step has no block to reject
        look_ahead = self.look_ahead(step, committed + list(tree.tokens), next_k, rejections=rejections,
                                     abandon=abandon, grow_until=answered if self.growing else None)
        task = asyncio.create_task(look_ahead)
        try:
            outcome = await verify
        except BaseException:
            abandon.set()
            sessions.defer(task)
            await sessions.settle_drafter()
            raise
        answered.set()
        # A guess can come true only if every draft before the last guessed position was accepted.
        guessed_from = len(tree) - (1 if rejections else 0)
        if len(outcome.accepted_nodes) < guessed_from:
            abandon.set()
            sessions.defer(task)  # the next drafter call waits for it
            step.counts.pre_drafts_dropped += 1
            return outcome
        try:
            predrafts = await task
        except DrafterDown as exc:  # block n is verified; only the look-ahead is lost
            step.drafter_lost(exc.cause)
            return outcome
        except Exception as exc:  # the verifier committed block n already: do not fail for the look-ahead
            log.warning("pre-draft failed (%s: %s); drafting afresh next iteration", type(exc).__name__, exc)
            step.counts.pre_drafts_dropped += 1
            return outcome
        truth = committed + list(outcome.tokens)
        self.predraft = next((p for p in predrafts if p.context == truth), None)
        if self.predraft is None:
            step.counts.pre_drafts_dropped += 1
        return outcome

    async def look_ahead(
        self, step: Step, context: list[int], k: int, *, rejections: int, abandon: asyncio.Event,
        grow_until: asyncio.Event | None = None,
    ) -> list[PreDraft]:
        """Guess what the verifier commits after `context` and draft k tokens after each guess.

        With `grow_until`, the guesses get one token each, then the first bonus guess's block grows
        one token per call until that event is set (or k tokens). Returns [] when abandoned (no guess
        can come true any more) before the blocks were drafted.
        """
        sessions, timeline = step.sessions, step.timeline
        first_k = 1 if grow_until is not None else k
        result = await sessions.lookahead(context, k=first_k, bonus_guesses=self.bonus_guesses(first_k),
                                          rejection_guesses=rejections, timeline=timeline)
        if abandon.is_set():
            return []
        ranks = {False: 0, True: 0}
        predrafts = []
        for branch in result.branches:
            assumed = (context[:-1] if branch.replaces_last else context) + [int(branch.token)]
            kind = branch.replaces_last
            predrafts.append(PreDraft(assumed, branch.draft, rejection=kind, rank=ranks[kind]))
            ranks[kind] += 1
        if grow_until is None or not predrafts or predrafts[0].rejection:
            return predrafts
        first = predrafts[0]
        steps = [first.draft]
        one = sequence_parents(1)
        while len(steps) < k and len(steps[-1].tokens) == 1 and not (grow_until.is_set() or abandon.is_set()):
            grown = first.context + [s.tokens[0] for s in steps]
            steps.append(await sessions.draft(grown, shape=one, timeline=timeline))
        if abandon.is_set():
            return []
        steps = [s for s in steps if len(s.tokens) == 1]  # the drafter stops short at a full context
        if steps:
            predrafts[0] = PreDraft(first.context, chain(steps, want_rows=sessions.want_rows))
        return predrafts


def chain(steps: Sequence[DraftResult], *, want_rows: bool) -> DraftResult:
    """One sequence draft from one-token drafts made one after another (rows in the same layout)."""
    tokens = [s.tokens[0] for s in steps]
    probs = None
    if want_rows:
        first_rows = [draft_rows(s, 1) for s in steps]
        probs = torch.cat(first_rows + [torch.zeros_like(first_rows[0])])  # the leaf row stays zero
    return DraftResult(tokens=tokens, parents=sequence_parents(len(tokens)), draft_probs=probs,
                       forward_seconds=sum(s.forward_seconds for s in steps))

"""The hybrid source, the default of `up`: a chooser over proposers. Each iteration verifies the
model-free proposal that promises the most tokens per second when that beats the draft model's best
choice (which may itself be a target-only step), else it does what the model proposer plans. With no
draft model: model-free or target-only.

The choice reads the proposal (its tokens and their estimated probabilities), the measured worth of
each model-free source (accepted ÷ predicted tokens: the request's own record, shrunk towards the
orchestrator's record for requests of its kind, greedy or sampled, adaptation.request_calibration),
the wall time by verified positions (adaptation.SourceEstimates) and the model proposer's own
estimate (Proposer.expected_rate: its online draft length, adaptation.DraftLength). It is made from
the committed prefix and finished iterations only, before the target's pass reads the draft, so it
keeps the output's law like any draft length does (docs/algorithms.md §8, §15). A seeded request
asks for replay, so its choice reads no timings and no other request: the request's own n-grams
(lookup) when they promise at least SEEDED_MIN_EXPECTED tokens, else the model.

Under load (more requests running than OrchestratorConfig.draft_model_max_requests) the model does not
plan: where the drafter shares the verifier's cores, its passes then cost the verifier's batched
passes more than its drafts save. The choice reads the orchestrator's request count, never the
output, so like a draft length it keeps the output's law; seeded requests never read it.

Taking the model back costs something: after model-free turns (or at a request's start) the drafter
must first take in every committed token it has not seen. A timed request lets the model draft
again only when its expected saving over the rest of the request pays for that catch-up
(adaptation.drafter_catch_up_pays); otherwise it takes a target-only step without the drafter.

The prompt's pass. A request's first pass (or any pass in which the verifier takes in more than
STEADY_CATCH_UP committed tokens: a resumed request's context) drafts from the prompt's last
n-gram, which at a chat template's end ("assistant\n") is short and followed elsewhere in the
prompt by anything but the answer: in 35 traced grounded requests on a flushed cache such drafts
(1–16 nodes) were never accepted (bench/RESULTS.md, "An int8 kernel of our own"). So their worth has
its own shared record (SourceEstimates.prompt_calibration, faded by prompt passes, since one comes
a request), apart from the steady iterations' and from the request's own: where recent requests'
answers start the way this one does (an agent loop, a warm cache), the record keeps them; where
they miss, it stops paying their rows. Like every calibration it reads finished iterations only,
so it keeps the output's law.

The first token. A streamed request's caller waits on the pass that makes its first token (the time to
first token), and that pass takes in the prompt's uncached rows: a draft's rows would lengthen it by
their share of its rows (on two CPU cores, an 8-node draft on 23 prompt rows: about a quarter more),
while the same source offers the same draft again one pass later. So a timed streamed request's first
pass carries no draft (HybridChooser.holds_first_token) while no other request runs; a unary call's
caller waits for the last token only, and there the prompt's pass is the cheapest place for a draft.
Beside other requests the first token's pass is a batched one, whose time their rows and the prefill
chunk budget set; there the rule bought nothing (8 clients: TTFT p50 11.7–11.9 s without the draft,
9.1–9.8 s with it; bench/RESULTS.md, "A stream's first token"), so it is off. Seeded requests keep
their choice: a replay must not depend on the door the request came through.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from orchestrator.adaptation import (
    PRIOR_SLOPE,
    REQUEST_FORGET,
    STEADY_CATCH_UP,
    SourceEstimates,
    drafter_catch_up_pays,
    model_share,
    request_calibration,
)
from orchestrator.drafting.base import Draft, Plan, Proposer, ProposerBase, Step, verify_draft
from orchestrator.drafting.model_free import ModelFreeProposer
from specdec.defaults import DraftSource
from specdec.engine.api import VerifyOutcome
from specdec.generation import IterationRecord
from specdec.model_free import Proposal

SEEDED_MIN_EXPECTED = 1.0  # expected accepted tokens a seeded request's lookup draft must promise


class HybridChooser(ProposerBase):
    """Per iteration, one of the model-free proposers, the model proposer, or a target-only step
    (module docstring). What it chose lives in the iteration's Step (turn, predicted, steady)."""

    source = DraftSource.HYBRID

    def __init__(self, free: Sequence[ModelFreeProposer], model: Proposer | None, estimates: SourceEstimates,
                 *, timed: bool, sampled: bool = False, busy: Callable[[], bool] | None = None,
                 requests_running: Callable[[], int] = lambda: 1, max_nodes: int = 0) -> None:
        """`busy()`: whether the deployment is too loaded for the draft model now (more requests run
        than OrchestratorConfig.draft_model_max_requests); None: never. `requests_running()`: the
        orchestrator's running requests, this one included (holds_first_token). `max_nodes`: how far a timed
        request's model-free drafts may grow past their sources' configured caps where the measured
        pass time allows (SourceEstimates.node_cap; 0 or below a cap: the caps stay)."""
        self.free = {proposer.source: proposer for proposer in free}
        self.max_nodes = max_nodes
        self.model = model
        self.busy = busy
        self.requests_running = requests_running
        self.estimates = estimates
        self.timed = timed  # False: a seeded request (no timings in the choice)
        # Greedy and sampled requests accept a draft differently: their records are kept apart.
        self.kind = "sampled" if sampled else "greedy"
        self.own_predicted: dict[str, float] = {}  # this request's model-free drafts, by source
        self.own_accepted: dict[str, float] = {}
        self._tokens = 0  # tokens this request emitted so far, and those of iterations without a
        self._model_side_tokens = 0  # model-free draft (model_share)

    def plan(self, step: Step) -> Plan | None:
        step.steady = step.sessions.lag(step.committed, drafting=False) <= STEADY_CATCH_UP
        if self.holds_first_token(step):
            return None
        model_may = self.model is not None and not (self.busy is not None and self.busy()) \
            and self.model_pays(step)
        best: tuple[ModelFreeProposer, Proposal] | None = None
        best_rate = -math.inf
        for proposer in self.free.values():
            proposal = proposer.offer(step, self.node_cap(proposer))
            if proposal is None:
                continue
            cut, rate = self.best_cut(proposal, beside_model=model_may, prompt_pass=not step.steady)
            if cut is None:
                self.forget(proposal.source)
            elif rate > best_rate:
                best, best_rate = (proposer, cut), rate
        if best is not None:
            proposer, cut = best
            step.turn, step.predicted = proposer.source, cut.expected_accepted()
            return proposer.plan_for(step, cut)
        if not model_may:
            return None
        assert self.model is not None
        step.turn = DraftSource.MODEL
        return self.model.plan(step)

    def holds_first_token(self, step: Step) -> bool:
        """Whether this pass makes a streamed request's first token, which a draft would hold back,
        with no other request running: it is then a target-only step (module docstring, "The first
        token")."""
        return (self.timed and step.run.streamed and not step.run.state.generated
                and self.requests_running() <= 1)

    def node_cap(self, proposer: ModelFreeProposer) -> int:
        """The proposer's node budget this iteration: its configured cap, raised by the measured pass
        time for a timed request (SourceEstimates.node_cap); a seeded request reads no timings."""
        if not self.timed:
            return proposer.max_nodes
        return self.estimates.node_cap(proposer.max_nodes, self.max_nodes)

    def model_pays(self, step: Step) -> bool:
        """Whether the draft model may plan this iteration: always when it has (almost) every committed
        token already, else only when its catch-up pays (module docstring)."""
        if not self.timed or step.sessions.lag(step.committed, drafting=True) <= STEADY_CATCH_UP:
            return True
        return drafter_catch_up_pays(
            remaining_tokens=step.settings.max_new_tokens - len(step.run.state.generated),
            share=model_share(self._model_side_tokens, self._tokens, self.estimates.model_side_share()),
            step_seconds=self.estimates.iteration_seconds(1), model_rate=self.model_rate(),
            catch_up_seconds=step.sessions.drafter_catch_up_seconds(step.committed))

    def best_cut(self, proposal: Proposal, *, beside_model: bool = True,
                 prompt_pass: bool = False) -> tuple[Proposal | None, float]:
        """The proposal's best cut when it promises more tokens per second than the alternatives (a
        target-only step, and the model's best choice when `beside_model`), else None; and its expected
        tokens per second. The cut keeps the m likeliest nodes (by path probability, so parents stay),
        with m maximising (1 + c_s·Σ path probabilities) / W(m + 1).
        Untimed (a seeded request): the whole proposal when it promises SEEDED_MIN_EXPECTED tokens,
        rated by that promise. `prompt_pass`: the pass also takes in the prompt, whose drafts have their
        own record (module docstring, "The prompt's pass")."""
        if not self.timed:
            promise = proposal.expected_accepted()
            return (proposal, promise) if promise >= SEEDED_MIN_EXPECTED else (None, promise)
        est = self.estimates
        calibration = self.calibration(proposal.source, prompt_pass=prompt_pass)
        step_seconds = est.iteration_seconds(1)
        measured = math.isfinite(step_seconds)
        best_m, best_rate, expected = 0, -math.inf, 0.0
        for m, path_prob in enumerate(sorted(proposal.path_probs(), reverse=True), start=1):
            expected += path_prob
            # Nothing measured yet: a pass of m + 1 positions costs about 1 + PRIOR_SLOPE·m steps.
            seconds = est.iteration_seconds(m + 1) if measured else 1.0 + PRIOR_SLOPE * m
            rate = (1.0 + calibration * expected) / seconds
            if rate > best_rate:
                best_m, best_rate = m, rate
        other = 1.0 / step_seconds if measured else 1.0
        model_rate = self.model_rate() if beside_model else math.nan
        if measured and math.isfinite(model_rate):
            other = max(other, model_rate)
        if best_rate <= other:
            return None, best_rate
        return proposal.truncated(best_m), best_rate

    def calibration(self, source: str, *, prompt_pass: bool = False) -> float:
        """c_s for this request: its own record shrunk towards the orchestrator's for its kind; on
        the prompt's pass the orchestrator's record of prompt passes alone."""
        if prompt_pass:
            return self.estimates.prompt_calibration(self._key(source))
        return request_calibration(self.estimates.calibration(self._key(source)),
                                   self.own_predicted.get(source, 0.0), self.own_accepted.get(source, 0.0))

    def forget(self, source: str) -> None:
        """Fade this request's own record of `source` (REQUEST_FORGET): a refused proposal teaches
        nothing, so old misses must not refuse every later one."""
        if source in self.own_predicted:
            self.own_predicted[source] *= REQUEST_FORGET
            self.own_accepted[source] *= REQUEST_FORGET

    def _key(self, source: str) -> str:
        return f"{source}:{self.kind}"

    def model_rate(self) -> float:
        """The model proposer's expected tokens per second at its best choice (nan: unknown)."""
        return self.model.expected_rate() if self.model is not None else math.nan

    async def draft(self, step: Step, plan: Plan) -> Draft:
        return await self._planner(step).draft(step, plan)

    async def verify(self, step: Step, draft: Draft) -> VerifyOutcome:
        if step.turn != DraftSource.MODEL:
            return await verify_draft(step, draft)
        assert self.model is not None
        return await self.model.verify(step, draft)

    def settle(self, step: Step, draft: Draft, outcome: VerifyOutcome, record: IterationRecord) -> None:
        free_turn, model_turn = step.turn in self.free, step.turn == DraftSource.MODEL
        emitted = len(record.emitted)
        self._tokens += emitted
        self._model_side_tokens += 0 if free_turn else emitted
        if self.timed:
            self.estimates.observe_tokens(model_side=0 if free_turn else emitted, tokens=emitted)
        alone = not model_turn or (draft.target_only and not _beside_look_ahead(draft))
        # An iteration without the draft model, its pass alone: what W(n) measures (not one beside
        # the run's abandoned look-ahead, which ran at the drafter-shared width).
        if alone and not draft.fallback and not step.beside_abandoned:
            source = draft.source if free_turn else None
            steady_source = source if step.steady else None  # a prompt pass's draft: its own record
            self.estimates.observe(self._key(steady_source) if steady_source else None,
                                   predicted=step.predicted,
                                   accepted=record.accepted, positions=record.num_drafted + 1,
                                   wall_seconds=record.end - record.start, steady=step.steady,
                                   pass_calls=outcome.pass_calls, pass_rows=outcome.pass_rows)
            if source and not step.steady:
                self.estimates.observe_prompt_draft(self._key(source), predicted=step.predicted,
                                                    accepted=record.accepted)
            elif source:
                self.own_predicted[source] = self.own_predicted.get(source, 0.0) + step.predicted
                self.own_accepted[source] = self.own_accepted.get(source, 0.0) + record.accepted
        if model_turn:
            assert self.model is not None
            self.model.settle(step, draft, outcome, record)

    def close(self, committed: list[int]) -> None:
        for proposer in self.free.values():
            proposer.close(committed)
        if self.model is not None:
            self.model.close(committed)

    def _planner(self, step: Step) -> Proposer:
        """The proposer whose plan the step carries."""
        if step.turn == DraftSource.MODEL:
            assert self.model is not None
            return self.model
        return self.free[step.turn]


def _beside_look_ahead(draft: Draft) -> bool:
    return draft.plan is not None and draft.plan.step_ahead

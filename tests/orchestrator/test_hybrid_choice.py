"""The hybrid source's choice (orchestrator.drafting.hybrid): a request's own record of model-free
drafts decides after a few drafts, and greedy and sampled requests keep separate shared records, so
open-ended work beside input-grounded work does not borrow the grounded work's acceptance; the draft
model is taken back after model-free turns only when its catch-up pays."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from orchestrator.adaptation import (
    MODEL_SHARE_PRIOR,
    REQUEST_FORGET,
    REQUEST_PRIOR,
    SourceEstimates,
    drafter_catch_up_pays,
    model_share,
    request_calibration,
)
from orchestrator.drafting.base import ProposerBase
from orchestrator.drafting.hybrid import HybridChooser
from specdec.model_free import Proposal

CHAIN = Proposal(tokens=(5, 6, 7, 8, 9), parents=(-1, 0, 1, 2, 3), probs=(0.95,) * 5, match_len=6,
                 source="suffix")


def _estimates(*, greedy_accepts: bool, sampled_accepts: bool) -> SourceEstimates:
    """Shared records: W(n) = 0.1 + 0.03·n s, and 40 drafts per kind accepted fully or not at all."""
    estimates = SourceEstimates()
    for n in range(1, 7):
        for _ in range(3):
            estimates.observe(None, predicted=0.0, accepted=0, positions=n, wall_seconds=0.1 + 0.03 * n)
    for kind, accepts in (("greedy", greedy_accepts), ("sampled", sampled_accepts)):
        for _ in range(40):
            estimates.observe(f"suffix:{kind}", predicted=4.0, accepted=4 if accepts else 0, positions=5,
                              wall_seconds=0.25)
    return estimates


def _hybrid(estimates: SourceEstimates, *, sampled: bool = False) -> HybridChooser:
    return HybridChooser([], None, estimates, timed=True, sampled=sampled)


def test_request_calibration_shrinks_towards_the_shared_value() -> None:
    assert request_calibration(0.8, 0.0, 0.0) == 0.8
    assert request_calibration(1.0, 20.0, 2.0) == (2.0 + REQUEST_PRIOR) / (20.0 + REQUEST_PRIOR)
    assert request_calibration(1.0, 1e6, 0.0) < 1e-5


def test_a_good_shared_record_drafts_until_the_request_own_record_says_otherwise() -> None:
    hybrid = _hybrid(_estimates(greedy_accepts=True, sampled_accepts=True))
    chosen = hybrid.best_cut(CHAIN)[0]
    assert chosen is not None and len(chosen) == 5
    # This request's own drafts were refused: 24 predicted tokens, none accepted.
    hybrid.own_predicted["suffix"], hybrid.own_accepted["suffix"] = 24.0, 0.0
    assert hybrid.calibration("suffix") < 0.25
    assert hybrid.best_cut(CHAIN)[0] is None
    # Another request starts from the shared record again.
    assert _hybrid(hybrid.estimates).best_cut(CHAIN)[0] is not None


class _Proposes:
    """A model-free source that proposes CHAIN at every prefix."""

    source = "suffix"
    max_nodes = 16

    def offer(self, step, max_nodes=None):
        return CHAIN

    def plan_for(self, step, proposal):
        return "free plan" if proposal is not None else None


def test_a_request_that_stopped_drafting_tries_again_after_refused_proposals() -> None:
    hybrid = HybridChooser([_Proposes()], None, _estimates(greedy_accepts=True, sampled_accepts=True),  # type: ignore[list-item]
                           timed=True)
    hybrid.own_predicted["suffix"], hybrid.own_accepted["suffix"] = 24.0, 0.0
    step = _step(lag=0, catch_up_seconds=0.0)
    plans = [hybrid.plan(step) for _ in range(30)]
    assert plans[0] is None, "early misses refuse the next proposal"
    tried = plans.index("free plan")  # then, with each refusal forgotten a little, it drafts again
    assert 1 < tried < 20, plans
    assert hybrid.own_predicted["suffix"] == 24.0 * REQUEST_FORGET ** tried


def test_greedy_and_sampled_requests_read_their_own_shared_records() -> None:
    estimates = _estimates(greedy_accepts=True, sampled_accepts=False)
    assert _hybrid(estimates).best_cut(CHAIN)[0] is not None
    assert _hybrid(estimates, sampled=True).best_cut(CHAIN)[0] is None
    assert _hybrid(estimates, sampled=True).calibration("suffix") < 0.2


# ------------------------------------------------------------------------------------------------
# taking the draft model back after model-free turns: its catch-up must pay


def test_catch_up_pays_only_when_the_expected_saving_exceeds_it() -> None:
    # a step 0.14 s, the model 8.7 tokens/s: about 0.025 s saved a token on the model's side
    common = {"step_seconds": 0.14, "model_rate": 8.7}
    assert drafter_catch_up_pays(remaining_tokens=128, share=1.0, catch_up_seconds=0.6, **common)
    assert not drafter_catch_up_pays(remaining_tokens=128, share=1.0, catch_up_seconds=4.2, **common)
    assert not drafter_catch_up_pays(remaining_tokens=90, share=0.25, catch_up_seconds=1.0, **common)
    # a model slower than a target-only step never pays for a catch-up
    assert not drafter_catch_up_pays(remaining_tokens=10_000, share=1.0, catch_up_seconds=0.01,
                                     step_seconds=0.14, model_rate=5.0)
    # unmeasured step or catch-up: the model drafts (that is how it gets measured)
    assert drafter_catch_up_pays(remaining_tokens=1, share=0.0, catch_up_seconds=99.0, step_seconds=math.nan,
                                 model_rate=8.7)
    assert drafter_catch_up_pays(remaining_tokens=1, share=0.0, catch_up_seconds=math.nan, **common)


@pytest.mark.parametrize("rate", [math.nan, 0.0])
def test_an_unmeasured_model_is_tried_unless_even_a_free_one_could_not_pay(rate) -> None:
    """Its rate unknown, the model's saving is bounded by a whole step a token: an open prompt's
    start (share 1) tries it, a code edit whose tokens came from model-free drafts (share 0.2) does
    not take in a 335-token prompt for it (the fresh server's first request, bench/RESULTS.md)."""
    common = {"step_seconds": 0.09, "model_rate": rate}
    assert drafter_catch_up_pays(remaining_tokens=128, share=1.0, catch_up_seconds=3.8, **common)
    assert not drafter_catch_up_pays(remaining_tokens=66, share=0.2, catch_up_seconds=3.8, **common)
    # the bound itself: pays exactly when remaining × share × step exceeds the catch-up
    assert drafter_catch_up_pays(remaining_tokens=100, share=0.5, catch_up_seconds=4.4, **common)
    assert not drafter_catch_up_pays(remaining_tokens=100, share=0.5, catch_up_seconds=4.6, **common)


def test_model_share_starts_at_one_and_follows_the_request() -> None:
    assert model_share(0, 0) == 1.0
    assert model_share(4, 40) == (4 + MODEL_SHARE_PRIOR) / (40 + MODEL_SHARE_PRIOR)
    assert model_share(0, 10_000) < 0.01
    # a fresh request starts from the orchestrator's recent share
    assert model_share(0, 0, shared=0.1) == 0.1
    estimates = SourceEstimates()
    for _ in range(10):
        estimates.observe_tokens(model_side=1, tokens=10)  # a model-free draft made 9 of 10 tokens
    assert abs(estimates.model_side_share() - 0.1) < 1e-12
    assert math.isnan(SourceEstimates().model_side_share())


class _Sessions:
    def __init__(self, lag: int, catch_up_seconds: float) -> None:
        self._lag, self._catch_up = lag, catch_up_seconds

    def lag(self, committed, *, drafting: bool) -> int:
        return self._lag

    def drafter_catch_up_seconds(self, committed) -> float:
        return self._catch_up


class _Model(ProposerBase):
    """The model strategy: 8.7 tokens/s at its best; its plan is a marker."""

    def plan(self, step):
        return "model plan"

    def expected_rate(self) -> float:
        return 8.7


class _NoMatch:
    source = "suffix"
    max_nodes = 16

    def offer(self, step, max_nodes=None):
        return None

    def plan_for(self, step, proposal):
        return None


def _step(lag: int, catch_up_seconds: float, generated: int = 0, max_new_tokens: int = 128,
          streamed: bool = False):
    run = SimpleNamespace(state=SimpleNamespace(generated=[0] * generated), streamed=streamed)
    return SimpleNamespace(sessions=_Sessions(lag, catch_up_seconds), committed=[1] * 300, run=run,
                           settings=SimpleNamespace(max_new_tokens=max_new_tokens), turn="", predicted=0.0,
                           steady=True, beside_abandoned=False)


def _step_estimates() -> SourceEstimates:
    estimates = SourceEstimates()
    for _ in range(5):
        estimates.observe(None, predicted=0.0, accepted=0, positions=1, wall_seconds=0.14)
    return estimates


def test_the_hybrid_takes_the_model_back_only_when_its_catch_up_pays() -> None:
    def hybrid(timed: bool = True) -> HybridChooser:
        return HybridChooser([_NoMatch()], _Model(), _step_estimates(), timed=timed)  # type: ignore[list-item]

    assert hybrid().plan(_step(lag=8, catch_up_seconds=0.1)) == "model plan"  # steady: no catch-up
    assert hybrid().plan(_step(lag=40, catch_up_seconds=0.5)) == "model plan"  # 128 × 0.025 s > 0.5 s
    assert hybrid().plan(_step(lag=335, catch_up_seconds=4.2)) is None  # a long prompt: target-only
    assert hybrid().plan(_step(lag=40, catch_up_seconds=0.5, generated=120)) is None  # too late to pay
    grounded_server = hybrid()
    for _ in range(10):
        grounded_server.estimates.observe_tokens(model_side=1, tokens=10)
    assert grounded_server.plan(_step(lag=40, catch_up_seconds=0.5)) is None  # 128 × 0.1 × 0.025 s < 0.5 s
    assert hybrid(timed=False).plan(_step(lag=335, catch_up_seconds=4.2)) == "model plan"  # replay: untimed


def test_under_load_the_model_does_not_plan_and_seeded_requests_never_look() -> None:
    from orchestrator.drafting import DraftingContext, draft_model_busy

    load = {"active": 8}

    def hybrid(limit: int = 4, seeded: bool = False) -> HybridChooser:
        context = DraftingContext(SimpleNamespace(draft_model_max_requests=limit),  # type: ignore[arg-type]
                                  lambda: None, active_requests=lambda: load["active"])  # type: ignore[arg-type,return-value]
        return HybridChooser([_NoMatch()], _Model(), _step_estimates(), timed=not seeded,  # type: ignore[list-item]
                             busy=draft_model_busy(context, seeded))

    steady = _step(lag=0, catch_up_seconds=0.0)
    assert hybrid().plan(steady) is None  # 8 requests run, at most 4 may have the model: target-only
    assert hybrid(seeded=True).plan(steady) == "model plan"  # replay reads no load
    assert hybrid(limit=0).plan(steady) == "model plan"  # no limit
    load["active"] = 4
    assert hybrid().plan(steady) == "model plan"


class _ProposesEveryOther:
    """A model-free source with a proposal at every second prefix only."""

    source = "suffix"

    def __init__(self) -> None:
        self.calls = 0

    max_nodes = 16

    def offer(self, step, max_nodes=None):
        self.calls += 1
        return CHAIN if self.calls % 2 == 0 else None

    def plan_for(self, step, proposal):
        return "free plan" if proposal is not None else None


class _SettleCounter(_Model):
    def __init__(self) -> None:
        self.settled = 0

    def settle(self, step, draft, outcome, record) -> None:
        self.settled += 1


def test_a_free_turn_after_a_model_turn_is_settled_as_free() -> None:
    model = _SettleCounter()
    hybrid = HybridChooser([_ProposesEveryOther()], model,  # type: ignore[list-item]
                           _estimates(greedy_accepts=True, sampled_accepts=True), timed=True)
    step = _step(lag=0, catch_up_seconds=0.0)
    record = SimpleNamespace(emitted=[1, 2], accepted=1, num_drafted=1, start=0.0, end=0.1)
    draft = SimpleNamespace(target_only=False, fallback=False, source="suffix", plan=None)
    outcome = SimpleNamespace(pass_calls=2, pass_rows=6)
    assert hybrid.plan(step) == "model plan"
    hybrid.settle(step, draft, outcome, record)  # type: ignore[arg-type]
    assert model.settled == 1
    assert hybrid.plan(step) == "free plan"
    hybrid.settle(step, draft, outcome, record)  # type: ignore[arg-type]
    assert model.settled == 1, "the model strategy must not learn from a model-free draft"
    assert hybrid.own_accepted["suffix"] == 1


def _batched_estimates(calls: int) -> SourceEstimates:
    """W(r) = 0.1 + 0.03·r s by the pass's rows r, every pass shared by `calls` calls, each padded to
    the widest; suffix drafts accepted as predicted."""
    estimates = SourceEstimates()
    for n in range(1, 7):
        for _ in range(3):
            rows = calls * n
            estimates.observe(None, predicted=0.0, accepted=0, positions=n, wall_seconds=0.1 + 0.03 * rows,
                              pass_calls=calls, pass_rows=rows)
    for _ in range(40):
        estimates.observe("suffix:greedy", predicted=2.0, accepted=2, positions=3,
                          wall_seconds=0.1 + 0.09 * calls, pass_calls=calls, pass_rows=3 * calls)
    return estimates


def test_a_draft_is_charged_the_pass_every_call_of_the_batch_would_make() -> None:
    """Beside 7 other calls a pass carries 8 rows per verified position: W(B·n), not W(n)."""
    alone, shared = _batched_estimates(1), _batched_estimates(8)
    assert shared.batch_calls() == 8.0 and alone.batch_calls() == 1.0
    assert math.isclose(alone.iteration_seconds(4), 0.1 + 0.03 * 4, rel_tol=1e-9)
    assert math.isclose(shared.iteration_seconds(4), 0.1 + 0.03 * 32, rel_tol=1e-9)
    # A proposal worth drafting alone (each token 0.6 likely) is refused in a busy server's passes,
    # where a long one (0.95 each) still pays.
    modest = Proposal(tokens=(5, 6, 7, 8, 9), parents=(-1, 0, 1, 2, 3), probs=(0.6,) * 5, match_len=3,
                      source="suffix")
    assert _hybrid(alone).best_cut(modest)[0] is not None
    assert _hybrid(shared).best_cut(modest)[0] is None
    assert _hybrid(shared).best_cut(CHAIN)[0] is not None


def test_a_verifier_that_reports_no_pass_shape_is_read_as_alone() -> None:
    estimates = SourceEstimates()
    for n in (1, 2, 3):
        estimates.observe(None, predicted=0.0, accepted=0, positions=n, wall_seconds=0.1 * n)
    assert estimates.batch_calls() == 1.0
    assert math.isclose(estimates.iteration_seconds(2), 0.2, rel_tol=1e-9)


# ------------------------------------------------------------------------------------------------
# a streamed request's first token is not held back by a draft


@pytest.mark.parametrize("source", ["free", "model"])
def test_a_streamed_request_first_pass_carries_no_draft(source) -> None:
    """The pass that makes a streamed request's first token is a target-only step while it runs
    alone, whichever source would draft (its time is not a sample of W: it takes in the prompt); a
    unary call's first pass, a streamed one's later passes, a seeded request's first pass and a first
    pass beside other requests draft as before."""
    estimates = _estimates(greedy_accepts=True, sampled_accepts=True)
    free = [_Proposes()] if source == "free" else [_NoMatch()]
    drafted = "free plan" if source == "free" else "model plan"

    def hybrid(timed: bool = True, running: int = 1) -> HybridChooser:
        return HybridChooser(free, _Model(), estimates, timed=timed,  # type: ignore[arg-type]
                             requests_running=lambda: running)

    first = _step(lag=40, catch_up_seconds=0.1, streamed=True)
    assert hybrid().plan(first) is None
    assert first.steady is False, "a pass that takes in the prompt teaches no pass time"
    assert hybrid().plan(_step(lag=40, catch_up_seconds=0.1)) == drafted  # unary: the prompt's pass drafts
    assert hybrid().plan(_step(lag=1, catch_up_seconds=0.0, generated=1, streamed=True)) == drafted
    assert hybrid(timed=False).plan(_step(lag=40, catch_up_seconds=0.1, streamed=True)) == drafted
    # beside other requests the first token's pass is a batched one: the rule is off
    assert hybrid(running=3).plan(_step(lag=40, catch_up_seconds=0.1, streamed=True)) == drafted


# ------------------------------------------------------------------------------------------------
# the prompt's pass: its drafts keep their own shared record


def test_the_prompts_pass_reads_the_record_of_prompt_pass_drafts_alone() -> None:
    """Drafts on the pass that takes in the prompt (lag over STEADY_CATCH_UP) missed on recent
    requests: the next request's prompt pass is target-only, its steady passes still draft, and a
    fresh record (no prompt-pass drafts seen) drafts there as before."""
    estimates = _estimates(greedy_accepts=True, sampled_accepts=True)
    for misses in range(1, 9):
        estimates.observe_prompt_draft("suffix:greedy", predicted=4.0, accepted=0)
        for _ in range(40):  # each request's steady iterations between its prompt passes
            estimates.observe(None, predicted=0.0, accepted=0, positions=1, wall_seconds=0.13)
        if misses == 3:  # the cut shrinks first: one node still pays at W(2) = 0.16 s
            step = _step(lag=335, catch_up_seconds=0.0)
            assert HybridChooser([_Proposes()], None, estimates, timed=True).plan(step) == "free plan"  # type: ignore[list-item]
            assert step.predicted < 2.0
    hybrid = HybridChooser([_Proposes()], None, estimates, timed=True)  # type: ignore[list-item]
    assert hybrid.plan(_step(lag=335, catch_up_seconds=0.0)) is None
    assert hybrid.plan(_step(lag=0, catch_up_seconds=0.0)) == "free plan"
    fresh = HybridChooser([_Proposes()], None, _estimates(greedy_accepts=True, sampled_accepts=True),  # type: ignore[list-item]
                          timed=True)
    assert fresh.plan(_step(lag=335, catch_up_seconds=0.0)) == "free plan"
    # sampled requests keep theirs apart too
    assert HybridChooser([_Proposes()], None, estimates, timed=True,  # type: ignore[list-item]
                         sampled=True).plan(_step(lag=335, catch_up_seconds=0.0)) == "free plan"


def test_a_prompt_pass_draft_is_recorded_under_the_prompt_key_not_the_requests_own() -> None:
    estimates = _estimates(greedy_accepts=True, sampled_accepts=True)
    hybrid = HybridChooser([_Proposes()], None, estimates, timed=True)  # type: ignore[list-item]
    step = _step(lag=335, catch_up_seconds=0.0)
    assert hybrid.plan(step) == "free plan" and step.steady is False
    draft = SimpleNamespace(source="suffix", target_only=False, fallback=False, plan=None)
    outcome = SimpleNamespace(pass_calls=1.0, pass_rows=None)
    record = SimpleNamespace(emitted=[7], accepted=0, num_drafted=5, start=0.0, end=1.5)
    hybrid.settle(step, draft, outcome, record)  # type: ignore[arg-type]
    assert estimates.prompt_calibration("suffix:greedy") < 0.5  # 4 pseudo-tokens against ~4.3 predicted
    before = estimates.calibration("suffix:greedy")
    assert before > 0.9  # the steady record holds no prompt-pass draft
    assert hybrid.own_predicted == {}  # and so is the request's own
    steady = _step(lag=0, catch_up_seconds=0.0)
    assert hybrid.plan(steady) == "free plan" and steady.steady is True
    hybrid.settle(steady, draft, outcome, record)  # type: ignore[arg-type]
    assert hybrid.own_predicted["suffix"] > 0

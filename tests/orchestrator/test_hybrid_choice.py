"""The hybrid source's choice (orchestrator.drafting.hybrid): a request's own record of model-free
drafts decides after a few drafts, and greedy and sampled requests keep separate shared records, so
open-ended work beside input-grounded work does not borrow the grounded work's acceptance."""

from __future__ import annotations

from orchestrator.adaptation import REQUEST_PRIOR, SourceEstimates, request_calibration
from orchestrator.drafting.hybrid import HybridDrafts
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


def _hybrid(estimates: SourceEstimates, *, sampled: bool = False) -> HybridDrafts:
    return HybridDrafts(None, None, estimates, timed=True, sampled=sampled)  # type: ignore[arg-type]


def test_request_calibration_shrinks_towards_the_shared_value() -> None:
    assert request_calibration(0.8, 0.0, 0.0) == 0.8
    assert request_calibration(1.0, 20.0, 2.0) == (2.0 + REQUEST_PRIOR) / (20.0 + REQUEST_PRIOR)
    assert request_calibration(1.0, 1e6, 0.0) < 1e-5


def test_a_good_shared_record_drafts_until_the_request_own_record_says_otherwise() -> None:
    hybrid = _hybrid(_estimates(greedy_accepts=True, sampled_accepts=True))
    chosen = hybrid.choose(CHAIN)
    assert chosen is not None and len(chosen) == 5
    # This request's own drafts were refused: 24 predicted tokens, none accepted.
    hybrid.own_predicted["suffix"], hybrid.own_accepted["suffix"] = 24.0, 0.0
    assert hybrid.calibration("suffix") < 0.25
    assert hybrid.choose(CHAIN) is None
    # Another request starts from the shared record again.
    assert _hybrid(hybrid.estimates).choose(CHAIN) is not None


def test_greedy_and_sampled_requests_read_their_own_shared_records() -> None:
    estimates = _estimates(greedy_accepts=True, sampled_accepts=False)
    assert _hybrid(estimates).choose(CHAIN) is not None
    assert _hybrid(estimates, sampled=True).choose(CHAIN) is None
    assert _hybrid(estimates, sampled=True).calibration("suffix") < 0.2

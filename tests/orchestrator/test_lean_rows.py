"""RunSessions.verify with lean draft rows (docs/algorithms.md §12) against the real verifier engine:
what each round sends, the retry on draft_rows_needed, the mirror and the timeline."""

from __future__ import annotations

import pytest

from orchestrator.clients.inprocess import InProcessVerifierClient
from orchestrator.config import DRAFT_ROWS_MODES, OrchestratorConfig
from orchestrator.sessions import RunSessions
from orchestrator.timeline import Timeline
from specdec.cli.options import DRAFT_ROWS_CHOICES
from specdec.engine.api import DraftRequest, DraftRowsRequest, VerifyOutcome, VerifyRequest
from specdec.generation import GenerationRequest
from specdec.sampling import SamplingParams
from specdec.trees import DraftTree
from specdec.verification.base import MethodParams
from specdec.verification.lean import token_probs
from tests.orchestrator.helpers import make_run

PROMPT = [1, 2, 3]
T1 = SamplingParams(1.0)


class Recording(InProcessVerifierClient):
    """The in-process verifier, keeping every VerifyRequest it was sent."""

    def __init__(self, engine) -> None:
        super().__init__(engine)
        self.requests: list[VerifyRequest] = []

    async def verify(self, request: VerifyRequest) -> VerifyOutcome:
        self.requests.append(request)
        return await super().verify(request)


def draft(engines, shape: list[int], seed: int, leaf_rows: bool = False) -> tuple[DraftTree, object]:
    out = engines["draft"].draft(DraftRequest(f"lean-draft-{seed}", 0, PROMPT, shape, T1, seed,
                                              want_distributions=True, include_leaf_rows=leaf_rows))
    return DraftTree(tuple(out.tokens), tuple(out.parents)), out.draft_probs


async def verify(engines, mode: str, tree, probs, method: str, params: MethodParams, seed: int):
    verifier = Recording(engines["verifier"])
    run = make_run(PROMPT, seed=seed, method=method)
    sessions = RunSessions(run, None, verifier, draft_rows=mode)
    timeline = Timeline()
    outcome = await sessions.verify(list(PROMPT), tree, method=method, params=params, draft_probs=probs,
                                    timeline=timeline)
    assert sessions.verifier_mirror.held == PROMPT + outcome.tokens
    await verifier.release(run.session_id)
    return outcome, verifier.requests, timeline


async def test_a_rejection_is_resent_with_its_row_and_ends_as_the_full_verify(engines):
    retried = 0
    for seed in range(8):
        tree, probs = draft(engines, [-1, 0, 1], seed)
        params = MethodParams(seed=seed)
        full, full_sent, _ = await verify(engines, "full", tree, probs, "token", params, seed)
        lean, sent, timeline = await verify(engines, "lean", tree, probs, "token", params, seed)
        assert (lean.tokens, lean.accepted_nodes, lean.accept_flags) == (
            full.tokens, full.accepted_nodes, full.accept_flags)
        assert [r.lean for r in full_sent] == [False] and full_sent[0].draft_probs is probs
        first = sent[0]
        assert first.draft_probs is None and first.draft_token_probs == token_probs(tree, probs)
        assert first.draft_row_indices == [] and first.draft_row_values is None
        assert len(timeline.verify) == len(sent)
        if len(full.accepted_nodes) == len(tree):  # no rejection: one round
            assert len(sent) == 1
            continue
        retried += 1
        rejected = len(full.accepted_nodes)
        assert len(sent) == 2
        retry = sent[1]
        assert (retry.base_len, retry.append) == (len(PROMPT), [])  # the verifier holds the prompt
        assert retry.draft_row_indices == [rejected]
        assert retry.draft_row_values.equal(probs[rejected:rejected + 1])
        assert retry.draft_token_probs == first.draft_token_probs
        assert lean.forward_seconds > 0  # the first round's pass, summed in
    assert retried >= 2


async def test_rd_sends_the_tails_row_up_front(engines):
    params = MethodParams(a=0.9, k_max=3, seed=1)
    tree, probs = draft(engines, [-1], 1, leaf_rows=True)  # K = 1 < k_max
    outcome, sent, _ = await verify(engines, "lean", tree, probs, "rd", params, 1)
    assert sent[0].draft_row_indices == [1] and sent[0].draft_row_values.equal(probs[1:2])
    full, _, _ = await verify(engines, "full", tree, probs, "rd", params, 1)
    assert outcome.tokens == full.tokens


async def test_block_sends_its_rows_in_full_even_in_lean_mode(engines):
    tree, probs = draft(engines, [-1, 0], 2)
    _, sent, _ = await verify(engines, "lean", tree, probs, "block", MethodParams(seed=2), 2)
    assert [r.lean for r in sent] == [False] and sent[0].draft_probs is probs


class Asking:
    """A verifier that answers draft_rows_needed with the rows it is told to."""

    address = "asking"

    def __init__(self, asks: list[list[int]]) -> None:
        self.asks = asks

    async def verify(self, request: VerifyRequest) -> VerifyOutcome:
        rows = self.asks.pop(0) if self.asks else []
        return VerifyOutcome([] if rows else [1], [], [], len(request.tree_tokens), request.base_len,
                             draft_rows_needed=rows)


@pytest.mark.parametrize(("mode", "asks", "match"), [
    ("lean", [[1], [1]], r"asked for draft rows \[1\] .* carried \[1\]"),  # no progress
    ("lean", [[3]], r"rows \[3\] of a 2-node"),  # outside the layout
    ("full", [[0]], "full verify"),
])
async def test_a_verifier_that_asks_amiss_is_an_error(engines, mode, asks, match):
    tree, probs = draft(engines, [-1, 0], 3)
    sessions = RunSessions(make_run(PROMPT), None, Asking(asks), draft_rows=mode)
    with pytest.raises(RuntimeError, match=match):
        await sessions.verify(list(PROMPT), tree, method="token", params=MethodParams(), draft_probs=probs,
                              timeline=Timeline())


async def test_rows_asked_for_one_by_one_end_after_n_plus_1_retries(engines):
    tree, probs = draft(engines, [-1, 0], 4)
    sessions = RunSessions(make_run(PROMPT), None, Asking([[0], [1], [2]]), draft_rows="lean")
    timeline = Timeline()
    outcome = await sessions.verify(list(PROMPT), tree, method="token", params=MethodParams(),
                                    draft_probs=probs, timeline=timeline)
    assert outcome.tokens == [1] and len(timeline.verify) == 4


def test_the_cli_offers_the_config_choices():
    assert DRAFT_ROWS_CHOICES == DRAFT_ROWS_MODES and OrchestratorConfig().draft_rows == "lean"


async def test_the_config_setting_reaches_the_sessions(engines, make_orchestrator):
    verifier = Recording(engines["verifier"])
    orchestrator = make_orchestrator(draft_rows="full")
    orchestrator.verifier = verifier
    await orchestrator.generate(GenerationRequest(prompt_ids=PROMPT, max_new_tokens=6, seed=0, k=2))
    assert verifier.requests and not any(r.lean for r in verifier.requests)


# ------------------------------------------------------------------------------------------------
# Rows parked at the drafter (DraftRequest.lean_rows): only q(x̃) crosses; rows come on demand.


class RowsRecording:
    """The in-process drafter client, counting the DraftRows calls it serves."""

    def __init__(self, engine) -> None:
        from orchestrator.clients.inprocess import InProcessDrafterClient

        self.inner = InProcessDrafterClient(engine)
        self.fetched: list[list[int]] = []

    async def draft_rows(self, request):
        self.fetched.append(list(request.rows))
        return await self.inner.draft_rows(request)


def test_a_lean_draft_parks_the_rows_a_full_draft_sends(engines):
    from specdec.errors import InvalidRequest, SessionGone

    engine = engines["draft"]
    full = engine.draft(DraftRequest("parked-a", 0, PROMPT, [-1, 0, 1], T1, 5, want_distributions=True))
    lean = engine.draft(DraftRequest("parked-b", 0, PROMPT, [-1, 0, 1], T1, 5, want_distributions=True,
                                     lean_rows=True))
    tree = DraftTree(tuple(full.tokens), tuple(full.parents))
    assert (lean.tokens, lean.parents, lean.draft_probs) == (full.tokens, full.parents, None)
    assert lean.rows_id > 0 and lean.token_probs == token_probs(tree, full.draft_probs)  # bit for bit
    rows = engine.draft_rows(DraftRowsRequest("parked-b", lean.rows_id, [3, 0]))
    assert rows.equal(full.draft_probs[[3, 0]])
    with pytest.raises(InvalidRequest, match="outside the draft's rows"):
        engine.draft_rows(DraftRowsRequest("parked-b", lean.rows_id, [4]))
    again = engine.draft(DraftRequest("parked-b", 0, PROMPT, [-1], T1, 6, want_distributions=True,
                                      lean_rows=True))
    with pytest.raises(SessionGone, match="holds no draft rows"):  # a later lean draft replaced them
        engine.draft_rows(DraftRowsRequest("parked-b", lean.rows_id, [0]))
    engine.release("parked-b")
    with pytest.raises(SessionGone):
        engine.draft_rows(DraftRowsRequest("parked-b", again.rows_id, [0]))


async def test_a_parked_draft_verifies_as_its_full_rows_do_and_fetches_only_rejected_rows(engines):
    from orchestrator.sessions import ParkedRows

    fetched_any = 0
    for seed in range(8):
        engine = engines["draft"]
        session = f"parked-{seed}"
        result = engine.draft(DraftRequest(session, 0, PROMPT, [-1, 0, 1], T1, seed, want_distributions=True,
                                           lean_rows=True))
        tree = DraftTree(tuple(result.tokens), tuple(result.parents))
        full_rows = engine.draft_rows(DraftRowsRequest(session, result.rows_id, [0, 1, 2, 3]))
        params = MethodParams(seed=seed)
        full, _, _ = await verify(engines, "full", tree, full_rows, "token", params, seed)
        verifier = Recording(engines["verifier"])
        run = make_run(PROMPT, seed=seed, method="token")
        drafter = RowsRecording(engine)
        sessions = RunSessions(run, drafter, verifier, draft_rows="lean")
        parked = ParkedRows(list(result.token_probs), len(tree) + 1, session, result.rows_id)
        outcome = await sessions.verify(list(PROMPT), tree, method="token", params=params, draft_probs=parked,
                                        timeline=Timeline())
        assert (outcome.tokens, outcome.accepted_nodes) == (full.tokens, full.accepted_nodes)
        rejected = len(full.accepted_nodes) < len(tree)
        assert drafter.fetched == ([[len(full.accepted_nodes)]] if rejected else [])
        fetched_any += rejected
        await verifier.release(run.session_id)
    assert fetched_any >= 2


async def test_rows_lost_before_the_verify_decides_fail_the_request_clearly(engines):
    from orchestrator.sessions import ParkedRows
    from specdec.errors import PeerUnavailable

    engine = engines["draft"]
    for seed in range(20):  # a seed whose draft is rejected, so the rule needs a row
        result = engine.draft(DraftRequest("lost", 0, PROMPT, [-1, 0, 1], T1, seed, want_distributions=True,
                                           lean_rows=True))
        tree = DraftTree(tuple(result.tokens), tuple(result.parents))
        engine.release("lost")  # the drafter forgets the rows (a restart)
        run = make_run(PROMPT, seed=seed, method="token")
        sessions = RunSessions(run, RowsRecording(engine), Recording(engines["verifier"]), draft_rows="lean")
        parked = ParkedRows(list(result.token_probs), len(tree) + 1, "lost", result.rows_id)
        try:
            await sessions.verify(list(PROMPT), tree, method="token", params=MethodParams(seed=seed),
                                  draft_probs=parked, timeline=Timeline())
        except PeerUnavailable as exc:
            assert "lost the rows of a lean draft" in str(exc)
            return
    pytest.fail("no seed's draft was rejected")

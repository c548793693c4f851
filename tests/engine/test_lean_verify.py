"""The verifier engine's lean verify (docs/algorithms.md §12) on tiny models: a rule that reaches a
draft row it was not given commits nothing and names the row; the retry with that row reuses the
parked forward pass and decides exactly as the full rows do, draw for draw."""

from __future__ import annotations

import pytest
import torch

from specdec.engine.api import DraftRequest, VerifyRequest
from specdec.errors import InvalidRequest
from specdec.sampling import SamplingParams
from specdec.trees import DraftTree, optimal_tree_shape
from specdec.verification.base import MethodParams
from specdec.verification.lean import token_probs
from tests.engine.helpers import committed_of

T1 = SamplingParams(temperature=1.0)
PROMPT = [1, 2, 3]





def request(session: str, tokens, parents, method: str, params: MethodParams, **draft) -> VerifyRequest:
    return VerifyRequest(session, 0, list(PROMPT), list(tokens), list(parents), method, params, T1, **draft)


def lean_fields(tree: DraftTree, probs: torch.Tensor, rows: list[int]) -> dict:
    return {"draft_token_probs": token_probs(tree, probs), "draft_row_indices": rows,
            "draft_row_values": probs[rows] if rows else None}


def outcome_of(out) -> tuple:
    return out.tokens, out.accepted_nodes, out.accept_flags


SHAPES = [("token", [-1, 0, 1]), ("gsd-tree", optimal_tree_shape([0.5, 0.3], 5))]


@pytest.mark.parametrize(("method", "shape"), SHAPES, ids=["token", "gsd-tree"])
def test_a_rejection_asks_for_its_row_commits_nothing_and_the_retry_is_the_full_outcome(
    drafter, verifier, method, shape
) -> None:
    retried = 0
    for seed in range(12):
        draft = drafter.draft(DraftRequest(f"d-{method}-{seed}", 0, PROMPT, list(shape), T1, seed,
                                           want_distributions=True))
        tree, params = DraftTree(tuple(draft.tokens), tuple(draft.parents)), MethodParams(seed=seed)
        full = verifier.verify(request(f"full-{method}-{seed}", tree.tokens, tree.parents, method, params,
                                       draft_probs=draft.draft_probs))
        session, rows = f"lean-{method}-{seed}", []
        out = verifier.verify(request(session, tree.tokens, tree.parents, method, params,
                                      **lean_fields(tree, draft.draft_probs, rows)))
        if not out.draft_rows_needed:  # every draft accepted: no row was read
            assert outcome_of(out) == outcome_of(full) and out.accept_flags == [True] * tree.max_depth
            continue
        retried += 1
        assert out.tokens == [] and out.accepted_nodes == [] and out.forward_seconds > 0
        assert out.committed_len == len(PROMPT) and committed_of(verifier, session) == PROMPT
        if method == "token":  # the first rejected position's row
            assert out.draft_rows_needed == [len(full.accepted_nodes)]
        hits, asked = verifier.score_hits, verifier.stats()["draft_rows_requests"]
        while out.draft_rows_needed:  # the same request with the rows (base_len 0, the prompt again)
            rows += out.draft_rows_needed
            out = verifier.verify(request(session, tree.tokens, tree.parents, method, params,
                                          **lean_fields(tree, draft.draft_probs, sorted(rows))))
            assert out.score_reused and out.forward_seconds == 0.0  # counted once, first
        assert outcome_of(out) == outcome_of(full)
        retries = verifier.stats()["draft_rows_requests"] - asked + 1
        assert verifier.score_hits == hits + retries and len(rows) == retries
        assert committed_of(verifier, session) == PROMPT + out.tokens
    assert retried >= 3


def test_rd_tails_row_up_front_and_a_retry_as_the_mirror_sends_it(drafter, verifier) -> None:
    """RD with K = 2 < k_max = 3 carries row K; a rejection asks for its own row, and the retry
    may name the held sequence (base_len = its length, nothing appended)."""
    outcomes = set()
    for seed in range(10):
        params = MethodParams(a=0.5, k_max=3, seed=seed)
        draft = drafter.draft(DraftRequest(f"rd-{seed}", 0, PROMPT, [-1, 0], T1, seed,
                                           want_distributions=True, include_leaf_rows=True))
        tree, probs = DraftTree(tuple(draft.tokens), tuple(draft.parents)), draft.draft_probs
        full = verifier.verify(request(f"rd-full-{seed}", tree.tokens, tree.parents, "rd", params,
                                       draft_probs=probs))
        session = f"rd-lean-{seed}"
        out = verifier.verify(request(session, tree.tokens, tree.parents, "rd", params,
                                      **lean_fields(tree, probs, [2])))
        if out.draft_rows_needed:
            assert out.draft_rows_needed == [len(full.accepted_nodes)] and len(full.accepted_nodes) < 2
            rows = [2, *out.draft_rows_needed]
            out = verifier.verify(VerifyRequest(session, len(PROMPT), [], list(tree.tokens),
                                                list(tree.parents), "rd", params, T1,
                                                **lean_fields(tree, probs, sorted(rows))))
        assert outcome_of(out) == outcome_of(full)
        outcomes.add(len(full.accepted_nodes))
    assert {0, 2} <= outcomes or {1, 2} <= outcomes  # both a rejection and the tails row were met


def test_malformed_lean_requests_are_invalid(drafter, verifier) -> None:
    draft = drafter.draft(DraftRequest("bad", 0, PROMPT, [-1, 0], T1, 0, want_distributions=True))
    tree, probs = DraftTree(tuple(draft.tokens), tuple(draft.parents)), draft.draft_probs
    lean = lean_fields(tree, probs, [1])
    cases = [
        ({**lean, "draft_probs": probs}, "not both"),
        ({**lean, "draft_token_probs": lean["draft_token_probs"][:1]}, "1 values for 2 tree nodes"),
        ({**lean, "draft_token_probs": [0.5, float("nan")]}, "finite"),
        ({**lean, "draft_row_indices": [3]}, "outside"),
        ({**lean, "draft_row_values": torch.ones(1, 9)}, r"shape \[1, 8\]"),
        ({**lean, "draft_row_values": None}, "missing"),
    ]
    for fields, message in cases:
        with pytest.raises(InvalidRequest, match=message):
            verifier.verify(request("bad-lean", tree.tokens, tree.parents, "token", MethodParams(), **fields))
    # ERSD reads no draft rows: lean fields are ignored like full ones.
    ersd = request("ersd-lean", tree.tokens, tree.parents, "ersd", MethodParams(), **lean)
    assert verifier.verify(ersd).tokens

"""Lean verification with rows fetched on demand, as the verifier and the orchestrator run it
(docs/algorithms.md §12), on an enumerating or any rewindable RandomSource."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from specdec.methods import get_method
from specdec.trees import DraftTree
from specdec.verification.base import MethodParams, VerifyResult
from specdec.verification.dispatch import verify
from specdec.verification.lean import DraftRowsNeeded, LeanDraft, token_probs


def lean_form(tree: DraftTree, draft_probs: torch.Tensor, rows: set[int] | tuple[int, ...] = ()) -> LeanDraft:
    """The lean form of full rows: every node's q (as the orchestrator computes it) plus `rows`."""
    indices = tuple(sorted(rows))
    values = draft_probs[list(indices)] if indices else None
    return LeanDraft(tuple(token_probs(tree, draft_probs)), indices, values)


@dataclass
class LeanVerifier:
    """`verify` with the signature of dispatch.verify that runs the lean protocol: the rows known up
    front, then on every DraftRowsNeeded the source is rewound to where verification began (the
    verifier re-creates its source from the same key) and the rule re-runs with those rows added.

    check_full: also rewind and run the full rows on the same draws; the results must be equal.
    perturb: changes the node values before they are sent (a broken lean form, for negative tests).
    """

    check_full: bool = True
    perturb: Callable[[list[float]], list[float]] | None = None
    verifies: int = 0
    retries: int = 0

    def __call__(self, method: str, tree: DraftTree, target_probs: torch.Tensor,
                 draft_probs: torch.Tensor | None, params: MethodParams, source) -> VerifyResult:
        if draft_probs is None:  # nothing to send (a = 0, or a method that reads no rows)
            return verify(method, tree, target_probs, None, params, source)
        self.verifies += 1
        start = source.checkpoint()
        rows = set(get_method(method).rows_up_front(params, len(tree)))
        for _ in range(len(tree) + 2):  # the first round and at most one per row
            lean = lean_form(tree, draft_probs, rows)
            if self.perturb is not None:
                probs = tuple(self.perturb(list(lean.token_probs)))
                lean = LeanDraft(probs, lean.row_indices, lean.row_values)
            try:
                result = verify(method, tree, target_probs, lean, params, source)
            except DraftRowsNeeded as need:
                assert rows.isdisjoint(need.rows), f"rows {need.rows} asked for again (carried {rows})"
                rows |= set(need.rows)
                self.retries += 1
                source.rewind(start)
                continue
            if self.check_full:
                end = source.checkpoint()
                source.rewind(start)
                full = verify(method, tree, target_probs, draft_probs, params, source)
                assert (full.tokens, full.accepted_nodes, full.accept_flags) == (
                    result.tokens, result.accepted_nodes, result.accept_flags)
                assert source.checkpoint() == end  # the same draws, to the last one
            return result
        raise AssertionError(f"lean {method} kept asking for rows (carried {sorted(rows)})")

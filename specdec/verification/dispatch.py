"""The one entry point of verification, `verify`: checks what is common to every method, then runs
the method's rule from the registry (specdec.methods) on lazy float64 row views (base.Rows), the
draft side either the full rows or a lean draft (lean.LeanRows, docs/algorithms.md §12).
"""

from __future__ import annotations

import torch

from specdec.methods import verification_method
from specdec.randomness import RandomSource
from specdec.trees import DraftTree
from specdec.verification.base import MethodParams, Rows, VerificationError, VerifyResult, check_rows
from specdec.verification.lean import LeanDraft, LeanRows, check_lean


def verify(
    method: str,
    tree: DraftTree,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | LeanDraft | None = None,
    params: MethodParams | None = None,
    source: RandomSource | None = None,
    *,
    deterministic: bool = False,
) -> VerifyResult:
    """Run one verification of `tree` with `method` (see base.py for the row layout).

    `draft_probs` are the full draft rows [n + 1, V], or a LeanDraft (each node's q plus some
    rows), or None for methods that need none (`Method.needs_rows`). With a LeanDraft the rule
    raises lean.DraftRowsNeeded when it reaches a row not carried; run again with those rows and
    the same `source` state, it decides exactly as with the full rows. `source` supplies every
    random draw and may be None only for ERSD, which is driven by position-keyed races.
    """
    params = params or MethodParams()
    spec = verification_method(method)
    check_rows(tree, target_probs, "target")
    vocab = int(target_probs.shape[1])
    if vocab < 1:
        raise VerificationError("target distributions have an empty vocabulary")
    bad = [t for t in tree.tokens if not 0 <= t < vocab]
    if bad:
        raise VerificationError(f"draft tokens {bad} lie outside the vocabulary [0, {vocab})")
    target = Rows(target_probs, "target")
    if deterministic:
        if draft_probs is not None:
            raise VerificationError("a deterministic (model-free) draft carries no draft rows")
        rule = spec.verify_deterministic
        if source is None and spec.needs_random_source:
            raise VerificationError(f"method {method!r} needs a RandomSource")
        return rule(tree, target, None, params, source)
    draft: Rows | None = None
    if spec.needs_rows(params, len(tree)):
        if isinstance(draft_probs, LeanDraft):
            draft = LeanRows(tree, check_lean(len(tree), draft_probs, vocab), vocab)
        else:
            draft = Rows(check_rows(tree, draft_probs, "draft", vocab), "draft")
    if spec.needs_random_source and source is None:
        raise VerificationError(f"method {method!r} needs a RandomSource")
    return spec.verify(tree, target, draft, params, source)

"""The one entry point of verification, `verify`: checks what is common to every method, then runs
the method's rule from the registry (specdec.methods) on lazy float64 row views (base.Rows).
"""

from __future__ import annotations

import torch

from specdec.methods import verification_method
from specdec.randomness import RandomSource
from specdec.trees import DraftTree
from specdec.verification.base import MethodParams, Rows, VerificationError, VerifyResult, check_rows


def verify(
    method: str,
    tree: DraftTree,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
    params: MethodParams | None = None,
    source: RandomSource | None = None,
) -> VerifyResult:
    """Run one verification of `tree` with `method` (see base.py for the row layout).

    `draft_probs` may be None for methods that need none (`Method.needs_rows`); `source` supplies
    every random draw and may be None only for ERSD, which is driven by position-keyed races.
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
    draft: Rows | None = None
    if spec.needs_rows(params, len(tree)):
        draft = Rows(check_rows(tree, draft_probs, "draft", vocab), "draft")
    if spec.needs_random_source and source is None:
        raise VerificationError(f"method {method!r} needs a RandomSource")
    return spec.verify(tree, target, draft, params, source)

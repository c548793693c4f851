"""Randomised drafting (Toner et al., ICML 2025) with per-position coins (docs/algorithms.md §5).

Coins b_1, b_2, ... ~ Bernoulli(a) are flipped before drafting (`leading_heads`); the K leading
heads (capped at k_max) are the positions that get a draft. Each draft is accepted with
min(1, P_i/(a·Q_i)); a rejection, and the position after K < k_max drafts (a tails), emit from
norm((P_i − a·Q_i)+). K = k_max ends with Y ~ P_{K+1}. a = 1 is token verification, a = 0 plain
target sampling. Each position is the paper's one-step scheme, which is exact for every a.
"""

from __future__ import annotations

from specdec.methods import check_drafting_probability
from specdec.randomness import RandomSource
from specdec.trees import DraftTree
from specdec.verification.base import (
    MethodParams,
    Rows,
    VerificationError,
    VerifyResult,
    acceptance,
    rejection_rule,
    residual,
)


def check_k_max(k_max: int) -> None:
    if k_max < 1:
        raise VerificationError(f"RD needs k_max >= 1, got {k_max}")


def leading_heads(a: float, k_max: int, source: RandomSource) -> int:
    """K: coins ~ Bernoulli(a) flipped until the first tails or k_max heads (the orchestrator's draw)."""
    check_drafting_probability(a)
    check_k_max(k_max)
    heads = 0
    while heads < k_max and source.bernoulli(a):
        heads += 1
    return heads


def _has_drafts(tree: DraftTree, params: MethodParams) -> bool:
    """RD's parameter checks, then whether the step reads a draft row: only a = 0 does not (it
    never drafts, so the step samples the target's row); with a > 0 even an empty tree is the
    no-draft step, which emits from norm((P_1 − a·Q_1)+)."""
    check_drafting_probability(params.a)
    check_k_max(params.k_max)
    k = len(tree)
    if k > params.k_max:
        raise VerificationError(f"RD tree holds {k} drafts but k_max is {params.k_max}")
    if params.a == 0.0 and k:
        raise VerificationError(f"RD with a = 0 never drafts, got {k} draft tokens")
    return params.a != 0.0


@rejection_rule("rd", has_drafts=_has_drafts)
def verify_rd(
    tree: DraftTree, target: Rows, draft: Rows, params: MethodParams, source: RandomSource
) -> VerifyResult:
    a, k_max = params.a, params.k_max
    k = len(tree)
    positions = list(range(k))
    for i, x in enumerate(tree.tokens):
        if not source.bernoulli(acceptance(target.at([i], [x])[0], a * draft.at([i], [x])[0])):
            y = source.categorical(residual(target.row(i), a * draft.row(i)))
            return VerifyResult(list(tree.tokens[:i]) + [y], positions[:i], [True] * i + [False])
    if k == k_max:
        y = source.categorical(target.row(k))
    else:  # position k + 1 had tails: the no-draft step of the paper
        y = source.categorical(residual(target.row(k), a * draft.row(k)))
    return VerifyResult(list(tree.tokens) + [y], positions, [True] * k)

"""Token verification (Leviathan et al. 2023; Chen et al. 2023), plus the rejection test it shares.

Accept x̃_i with probability min(1, P_i(x̃_i) / Q_i(x̃_i)); at the first rejection emit
Y ~ norm((P_i − Q_i)+) and stop; if all k pass emit Y ~ P_{k+1}. Only two scalars per visited
position are needed until the one row that is sampled, so the cost follows the accepted length.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from specdec.randomness import RandomSource
from specdec.trees import DraftTree
from specdec.verification.base import MethodParams, VerificationError, VerifyResult, residual

if TYPE_CHECKING:
    from specdec.verification.methods import Rows


def acceptance(p: float, q: float) -> float:
    """min(1, p / q) with the edge cases fixed: p = 0 is never accepted, q = 0 < p always is."""
    if p <= 0.0:
        return 0.0
    if q <= 0.0 or p >= q:
        return 1.0
    return p / q


def require_sequence(tree: DraftTree, method: str) -> None:
    if not tree.is_sequence():
        raise VerificationError(
            f"method {method!r} verifies sequences only; got parents {list(tree.parents)}"
        )


def verify_token(
    tree: DraftTree,
    target: Rows,
    draft: Rows | None,
    params: MethodParams,
    source: RandomSource,
) -> VerifyResult:
    require_sequence(tree, "token")
    assert draft is not None
    k = len(tree)
    positions = list(range(k))
    for i, x in enumerate(tree.tokens):
        # Row by row: the work (row sums) stops where the path stops.
        if not source.bernoulli(acceptance(target.at([i], [x])[0], draft.at([i], [x])[0])):
            y = source.categorical(residual(target.row(i), draft.row(i)))
            return VerifyResult(list(tree.tokens[:i]) + [y], positions[:i], [True] * i + [False])
    y = source.categorical(target.row(k))
    return VerifyResult(list(tree.tokens) + [y], positions, [True] * k)

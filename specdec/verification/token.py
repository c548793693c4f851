"""Token verification (Leviathan et al. 2023; Chen et al. 2023), docs/algorithms.md §1.

Accept x̃_i with probability min(1, P_i(x̃_i) / Q_i(x̃_i)); at the first rejection emit
Y ~ norm((P_i − Q_i)+) and stop; if all k pass emit Y ~ P_{k+1}. Only two scalars per visited
position are needed until the one row that is sampled, so the cost follows the accepted length.
"""

from __future__ import annotations

from specdec.randomness import RandomSource
from specdec.trees import DraftTree
from specdec.verification.base import MethodParams, Rows, VerifyResult, acceptance, rejection_rule, residual


@rejection_rule("token")
def verify_token(
    tree: DraftTree, target: Rows, draft: Rows, params: MethodParams, source: RandomSource
) -> VerifyResult:
    k = len(tree)
    positions = list(range(k))
    for i, x in enumerate(tree.tokens):
        # Row by row: the work (row sums) stops where the path stops.
        if not source.bernoulli(acceptance(target.at([i], [x])[0], draft.at([i], [x])[0])):
            y = source.categorical(residual(target.row(i), draft.row(i)))
            return VerifyResult(list(tree.tokens[:i]) + [y], positions[:i], [True] * i + [False])
    y = source.categorical(target.row(k))
    return VerifyResult(list(tree.tokens) + [y], positions, [True] * k)

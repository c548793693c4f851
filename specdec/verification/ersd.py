"""ERSD verification with position-keyed exponential races (docs/algorithms.md §4).

At each node (from the root) the output is the winner of race(seed, position + depth) under the
target row of that node; if a child carries that token the path descends into it, otherwise the
winner is emitted and the iteration stops; at a leaf the winner is emitted too. The output is
therefore, token for token, what target-only race decoding would emit: the drafter only decides
how many of those tokens one target pass confirms. No RandomSource, no draft distributions.
"""

from __future__ import annotations

from specdec.races import race_winner_at, sole_support
from specdec.randomness import RandomSource
from specdec.trees import DraftTree
from specdec.verification.base import MethodParams, Rows, VerificationError, VerifyResult, descend


def verify_ersd(
    tree: DraftTree,
    target: Rows,
    draft: Rows | None,
    params: MethodParams,
    source: RandomSource | None = None,
) -> VerifyResult:
    if params.position < 0:
        raise VerificationError(f"position must be >= 0, got {params.position}")

    def winner(node: int, depth: int) -> int:
        # argmin e/D does not change when D is scaled, so the raw row is used as sent (read in
        # float64 on the race's device, the CPU) and no normalisation pass is needed.
        row = target.raw[node + 1]
        token = sole_support(row)
        if token is None:
            token = race_winner_at(params.seed, params.position + depth, row)
            if token is None:
                raise VerificationError(f"target row {node + 1} has no positive mass")
        return token

    return descend(tree, winner)

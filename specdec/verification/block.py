"""Block verification (Sun et al., ICLR 2025, Algorithm 2), exactly as docs/algorithms.md §2.

Unlike token verification the whole block is judged jointly: with running weights
w_i = min(1, w_{i−1} P_i(x̃_i)/Q_i(x̃_i)) every prefix length i passes independently with
probability h_i, and the LAST prefix that passes is kept. Never accepts fewer tokens in
expectation than token verification, and is optimal among verifiers that see only the draft
path's conditionals.
"""

from __future__ import annotations

from specdec.randomness import RandomSource
from specdec.trees import DraftTree
from specdec.verification.base import MethodParams, Rows, VerifyResult, rejection_rule, residual


def block_weights(p: list[float], q: list[float]) -> list[float]:
    """w_1..w_k with w_0 = 1 (w stays 0 once it hits 0; q = 0 < p caps at 1)."""
    weights: list[float] = []
    w = 1.0
    for pi, qi in zip(p, q, strict=True):
        if w <= 0.0 or pi <= 0.0:
            w = 0.0
        elif qi <= 0.0:
            w = 1.0
        else:
            w = min(1.0, w * pi / qi)
        weights.append(w)
    return weights


@rejection_rule("block")
def verify_block(
    tree: DraftTree, target: Rows, draft: Rows, params: MethodParams, source: RandomSource
) -> VerifyResult:
    k = len(tree)
    positions = list(range(k))
    w = block_weights(target.at(positions, tree.tokens), draft.at(positions, tree.tokens))

    # h_i for i < k needs r_i = Σ_x (w_i P_{i+1}(x) − Q_{i+1}(x))+ over rows 1..k−1: one [m, V] op,
    # limited to the leading rows with w_i > 0 (once w hits 0, r_i = 0 and so h_i = 0).
    h = [0.0] * k
    live = 0
    while live < k - 1 and w[live] > 0.0:
        live += 1
    r = target.positive_mass(draft, 1, live + 1, w[:live])
    for i in range(live):
        denominator = r[i] + (1.0 - w[i])  # exactly r when w_i = 1, so h_i = 1
        h[i] = r[i] / denominator if denominator > 0.0 else 0.0
    h[k - 1] = w[k - 1]

    tau = 0
    for i in range(k):  # all k draws, in order: the last prefix that passes wins
        if source.bernoulli(h[i]):
            tau = i + 1
    if tau == k:
        y = source.categorical(target.row(k))
    else:
        scale = 1.0 if tau == 0 else w[tau - 1]
        y = source.categorical(residual(target.row(tau), draft.row(tau), scale))
    flags = [True] * tau + ([False] if tau < k else [])
    return VerifyResult(list(tree.tokens[:tau]) + [y], positions[:tau], flags)

"""Draw and descend: the exact rule for a model-free draft (docs/algorithms.md §15).

A prompt-lookup or suffix-cache draft is deterministic: each node's draft distribution is one-hot at
its token. At each node (from the root) the rule draws y from the target row of that node; if a
child carries y the path descends into it, otherwise y is emitted and the iteration stops; at a
leaf y is emitted too. Every emitted token is therefore a draw from its target row given the
prefix, which is the target's own law. No exact rule can accept more: a child c can only be
accepted when the output at its position is c, which has probability p(c) under the target, so
P(accept at a node) ≤ Σ_children p(c), which this rule attains at every node.

Token verification with one-hot q (accept x̃ with probability p(x̃), residual norm((p − δ_x̃)+)),
block verification with one-hot q, and recursive rejection with each candidate's q one-hot in turn
are each this rule in law. gsd-tree's own rule is not: it reads one draft row per node, and with
several one-hot candidates it accepts the second one with probability 1 once the first is rejected
(§15). The registry routes the model-free drafts of token, block and gsd-tree here
(specdec.methods, `deterministic_rule`).
"""

from __future__ import annotations

from specdec.randomness import RandomSource
from specdec.trees import DraftTree
from specdec.verification.base import MethodParams, Rows, VerificationError, VerifyResult, descend


def verify_deterministic(
    tree: DraftTree,
    target: Rows,
    draft: Rows | None,
    params: MethodParams,
    source: RandomSource | None,
) -> VerifyResult:
    if source is None:
        raise VerificationError("draw-and-descend needs a RandomSource")
    return descend(tree, lambda node, _depth: source.categorical(target.row(node + 1)))

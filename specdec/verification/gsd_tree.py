"""Multi-candidate tree verification by recursive rejection (ERSD paper Algorithm 4, docs/algorithms.md §3).

The children of a node were drawn from Q without replacement; they are tried in rank order
against a running target P* and running draft Q*: accept child x̃ with probability
min(1, P*(x̃)/Q*(x̃)) and descend; on rejection P* ← norm((P* − Q*)+), Q*(x̃) ← 0,
Q* ← norm(Q*). If every child is rejected emit Y ~ P*; an accepted leaf emits Y ~ P there.
On a sequence this is token verification. The running rows are built only after a rejection,
so the first child of every node costs two scalars.
"""

from __future__ import annotations

import torch

from specdec.randomness import RandomSource
from specdec.trees import DraftTree
from specdec.verification.base import MethodParams, Rows, VerifyResult, acceptance, rejection_rule, residual


@rejection_rule("gsd-tree", sequences_only=False)
def verify_gsd_tree(
    tree: DraftTree, target: Rows, draft: Rows, params: MethodParams, source: RandomSource
) -> VerifyResult:
    node = -1
    accepted: list[int] = []
    flags: list[bool] = []
    while True:
        row = node + 1
        children = tree.children(node)
        if not children:
            y = source.categorical(target.row(row))
            break
        p_star: torch.Tensor | None = None  # running P*, Q*; None while still equal to P, Q
        q_star: torch.Tensor | None = None
        chosen: int | None = None
        for child in children:
            x = tree.tokens[child]
            if p_star is None or q_star is None:
                p, q = target.at([row], [x])[0], draft.at([row], [x])[0]
            else:
                p, q = float(p_star[x]), float(q_star[x])
            if source.bernoulli(acceptance(p, q)):
                chosen = child
                break
            if p_star is None or q_star is None:
                p_star, q_star = target.row(row), draft.row(row)
            p_star = residual(p_star, q_star)
            q_star = q_star.clone()  # the cached row must stay intact
            q_star[x] = 0.0
            total = float(q_star.sum())
            if total > 0.0:
                q_star /= total
        if chosen is None:
            assert p_star is not None
            flags.append(False)
            y = source.categorical(p_star)
            break
        flags.append(True)
        accepted.append(chosen)
        node = chosen
    tokens = [tree.tokens[n] for n in accepted] + [y]
    return VerifyResult(tokens, accepted, flags)

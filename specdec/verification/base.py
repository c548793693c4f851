"""The one interface every verification method implements.

Row layout of the distribution tensors (shape [n + 1, V] for a tree of n nodes):
  row 0      the distribution after the committed prefix (the root),
  row i + 1  the distribution after the path root → node i.
So the target rows cover every node plus "the node after each leaf" (the bonus token), and
`P_{k+1}` of a sequence of k drafts is row k. Draft rows follow the same layout; a method that
needs no draft distributions (ERSD) accepts `draft_probs=None`. Rows are the *warped*
distributions (specdec.sampling.warp_logits) of the request's sampling parameters.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specdec.trees import DraftTree

METHODS = ("token", "block", "ersd", "gsd-tree", "rd")


class VerificationError(ValueError):
    """The inputs do not fit the method (shapes, missing draft rows, bad parameters)."""


@dataclass(frozen=True)
class MethodParams:
    """Per-iteration parameters of a method.

    a:        RD drafting probability in [0, 1] (only `rd`).
    k_max:    RD cap on leading heads; when the tree holds K < k_max drafts, position K + 1 had
              tails and the bonus token comes from the RD residual (only `rd`).
    seed:     request seed; ERSD regenerates its races from it.
    position: absolute index (0-based, in the whole token sequence) of the token that follows
              the committed prefix — the race of a node at depth d is keyed on position + d - 1,
              and the race deciding the children of a node at depth d on position + d.
    """

    a: float = 1.0
    k_max: int = 0
    seed: int = 0
    position: int = 0


@dataclass
class VerifyResult:
    """What one verification emits.

    tokens:         accepted path tokens followed by exactly one extra token.
    accepted_nodes: tree node indices of the accepted path (root child first).
    accept_flags:   one flag per depth that was decided: True where the path went on, False at
                    the depth where it stopped (absent when every depth down to a leaf passed).
    """

    tokens: list[int]
    accepted_nodes: list[int] = field(default_factory=list)
    accept_flags: list[bool] = field(default_factory=list)

    @property
    def num_accepted(self) -> int:
        return len(self.accepted_nodes)


def residual(p: torch.Tensor, q: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """norm((scale·p − q)+); falls back to p when the positive part has no mass.

    The fallback is only reachable through float rounding (a zero residual means p ≤ q
    everywhere, so the rejection that leads here had probability zero).
    """
    diff = (scale * p - q).clamp_min(0.0)
    total = diff.sum()
    if total <= 0:
        return p / p.sum()
    return diff / total


def check_rows(tree: DraftTree, rows: torch.Tensor | None, name: str) -> None:
    if rows is None:
        raise VerificationError(f"{name} distributions are required by this method")
    if rows.dim() != 2 or rows.shape[0] != len(tree) + 1:
        raise VerificationError(
            f"{name} distributions must have shape [n + 1, V] = [{len(tree) + 1}, V], got {tuple(rows.shape)}"
        )

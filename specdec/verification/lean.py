"""Lean draft rows (docs/algorithms.md §12): verify from one draft probability per tree node, plus
only the raw draft rows a rule actually reads.

Token, rd and gsd-tree read Q at the drafted tokens along their path (two scalars per position)
and a whole draft row only where a draft is rejected (and rd's tails row K). So a lean verify
carries, per node i, q_i = norm(draft row parents[i] + 1)(tokens[i]) — computed by `Rows.at`,
bit-identical to what the rule would read from the full rows — and the rows known to be needed.
When the rule reaches a row it was not given, `LeanRows` raises `DraftRowsNeeded`; the verifier
then commits nothing and the caller resends the same request with those rows. The retry re-runs
the rule with the same seeded source, so it repeats every draw up to that row and ends exactly as
the full rows would have.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from specdec.trees import DraftTree
from specdec.verification.base import Rows
from specdec.verification.errors import VerificationError


class DraftRowsNeeded(Exception):
    """The rule read draft rows a lean verify did not carry; nothing was decided.

    Not a VerificationError (those are bad requests): the request is valid and is answered by
    a retry that carries `rows` too.
    """

    def __init__(self, rows: Iterable[int]) -> None:
        self.rows: tuple[int, ...] = tuple(sorted({int(r) for r in rows}))
        super().__init__(f"draft rows {list(self.rows)} are needed")


@dataclass(frozen=True)
class LeanDraft:
    """The draft side of a lean verify.

    token_probs: per tree node i, norm(draft row parents[i] + 1)(tokens[i]) in float64, as `Rows.at`
                 computes it (the function `token_probs` below).
    row_indices: the draft rows carried (layout of base.py), each once.
    row_values:  their raw float32 values, [len(row_indices), V]; None when no row is carried.
    """

    token_probs: tuple[float, ...]
    row_indices: tuple[int, ...] = ()
    row_values: torch.Tensor | None = None


def token_probs(tree: DraftTree, draft_probs: torch.Tensor) -> list[float]:
    """q of every node's token in its parent's row, read through `Rows` one row at a time — as
    token, rd and gsd-tree read them — so each value is bit-identical to the full path's."""
    rows = Rows(draft_probs, "draft")
    nodes = zip(tree.tokens, tree.parents, strict=True)
    return [rows.at([parent + 1], [token])[0] for token, parent in nodes]


def check_lean(num_nodes: int, lean: LeanDraft, vocab: int | None = None, name: str = "draft") -> LeanDraft:
    """The form of a lean draft for a tree of `num_nodes` nodes (V = `vocab` when given).

    Row values are checked like full rows, lazily where a rule reads them (base.Rows).
    """
    probs = lean.token_probs
    if len(probs) != num_nodes:
        raise VerificationError(f"{name}_token_probs holds {len(probs)} values for {num_nodes} tree nodes")
    bad = [i for i, v in enumerate(probs) if not (math.isfinite(v) and v >= 0.0)]
    if bad:
        raise VerificationError(
            f"{name}_token_probs must be finite and >= 0; nodes {bad[:8]} hold {[probs[i] for i in bad[:8]]}"
        )
    indices = lean.row_indices
    outside = [i for i in indices if not 0 <= i <= num_nodes]
    if outside:
        raise VerificationError(f"{name}_row_indices {outside[:8]} lie outside the rows [0, {num_nodes + 1})")
    if len(set(indices)) != len(indices):
        raise VerificationError(f"{name}_row_indices repeat rows: {list(indices)}")
    values = lean.row_values
    if values is None:
        if indices:
            raise VerificationError(f"{name}_row_values are missing for the rows {list(indices)}")
        return lean
    shape = tuple(values.shape)
    if len(shape) != 2 or shape[0] != len(indices) or (vocab is not None and shape[1] != vocab):
        want = f"[{len(indices)}, {'V' if vocab is None else vocab}]"
        raise VerificationError(f"{name}_row_values must have shape {want}, got {list(shape)}")
    if not values.is_floating_point():
        raise VerificationError(f"{name}_row_values must be floating point, got {values.dtype}")
    return lean


class LeanRows(Rows):
    """`Rows` of a lean draft: each node's q (parent row, node token) read from `token_probs`, the
    carried rows exactly as full rows would read; anything else raises DraftRowsNeeded.

    The carried rows sit at their own indices of an uninitialised [n + 1, V] buffer (`raw`), so
    every inherited computation (sums, rows, gathers, `positive_mass` as either side) is the full
    path's, bit for bit. Rows not carried are never read: every access checks first.
    """

    def __init__(self, tree: DraftTree, lean: LeanDraft, vocab: int, name: str = "draft") -> None:
        values = lean.row_values
        device = values.device if values is not None else None
        dtype = values.dtype if values is not None else torch.float32
        raw = torch.empty((len(tree) + 1, vocab), dtype=dtype, device=device)
        if values is not None and lean.row_indices:
            raw[list(lean.row_indices)] = values
        super().__init__(raw, name)
        self.carried = frozenset(lean.row_indices)
        nodes = zip(tree.tokens, tree.parents, lean.token_probs, strict=True)
        self._nodes = {(parent + 1, token): q for token, parent, q in nodes}  # siblings' tokens differ

    def _require(self, rows: Iterable[int]) -> None:
        missing = [r for r in rows if r not in self.carried]
        if missing:
            raise DraftRowsNeeded(missing)

    def sums(self, rows: Sequence[int]) -> list[float]:
        self._require(rows)
        return super().sums(rows)

    def row(self, i: int) -> torch.Tensor:
        self._require([i])
        return super().row(i)

    def at(self, rows: Sequence[int], tokens: Sequence[int]) -> list[float]:
        """A node's own (parent row, token) from its q, other entries of carried rows as `Rows.at`;
        else DraftRowsNeeded. Node values come first even when their row is carried, so a retry
        reads what the first attempt read, whatever the caller sent."""
        pairs = list(zip(rows, tokens, strict=True))
        others = [pair for pair in pairs if pair not in self._nodes]
        self._require(r for r, _ in others)
        read = dict(zip(others, super().at([r for r, _ in others], [t for _, t in others]), strict=True))
        return [self._nodes[pair] if pair in self._nodes else read[pair] for pair in pairs]

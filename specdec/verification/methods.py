"""The one entry point, `verify`, and the row view every method reads its distributions through.

`verify` validates what is common to all methods (known method, row shapes, token ids, source
present) and hands each method `Rows` views of the target and draft tensors. A `Rows` view reads
row i as norm(row_i) in float64 — the exact distribution the sampling side used — but only
materialises the rows a method actually touches: token-level methods need a handful of
scalars P_i(x̃_i), Q_i(x̃_i) and at most one full row (the residual), which keeps one call at
a few milliseconds even for a 150k vocabulary.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
import torch

from specdec.randomness import RandomSource
from specdec.trees import DraftTree
from specdec.verification import block, ersd, gsd_tree, rd, token
from specdec.verification.base import METHODS, MethodParams, VerificationError, VerifyResult, check_rows


class Rows:
    """Row-normalised float64 view of a [n + 1, V] distribution tensor (see base.py's row layout).

    Row i reads as norm(row i) in float64. Sums, normalised rows and checks (finite positive
    mass; non-negative entries of materialised rows and gathered values) are computed lazily,
    row by row, so the work follows the path a method walks — and rows it never reads (e.g. the
    draft rows after leaves) may hold anything.
    """

    def __init__(self, raw: torch.Tensor, name: str) -> None:
        if not raw.is_floating_point():
            raise VerificationError(f"{name} distributions must be floating point, got {raw.dtype}")
        self.raw = raw
        self.name = name
        self._sums: dict[int, float] = {}
        self._rows: dict[int, torch.Tensor] = {}

    @property
    def vocab(self) -> int:
        return int(self.raw.shape[1])

    def __len__(self) -> int:
        return int(self.raw.shape[0])

    def sums(self, rows: Sequence[int]) -> list[float]:
        """Float64 sums of the given raw rows, each checked to be a positive finite mass.

        Missing sums are computed in one reduction (a contiguous slice when possible).
        """
        missing = sorted({i for i in rows if i not in self._sums})
        if missing:
            first, last = missing[0], missing[-1]
            if last - first + 1 == len(missing):
                block = self.raw[first : last + 1]
            else:
                block = self.raw[torch.tensor(missing, device=self.raw.device)]
            if block.device.type == "cpu":
                # numpy's float64-accumulating pairwise sum reads float32 rows several times faster
                # than torch's mixed-dtype reduction (same precision class).
                totals = np.sum(block.detach().numpy(), axis=1, dtype=np.float64).tolist()
            else:
                totals = block.sum(dim=1, dtype=torch.float64).tolist()
            for i, total in zip(missing, totals, strict=True):
                if not (math.isfinite(total) and total > 0):
                    raise VerificationError(f"{self.name} row {i} is not a distribution (sum {total})")
                self._sums[i] = total
        return [self._sums[i] for i in rows]

    def row(self, i: int) -> torch.Tensor:
        """norm(row i) as float64 [V] (cached; never modify it in place)."""
        cached = self._rows.get(i)
        if cached is None:
            total = self.sums([i])[0]
            # One fresh float64 buffer normalised in place: large temporaries are what cost here.
            cached = torch.empty(self.vocab, dtype=torch.float64, device=self.raw.device)
            cached.copy_(self.raw[i]).div_(total)
            if float(cached.min()) < 0.0:
                raise VerificationError(f"{self.name} row {i} has negative entries")
            self._rows[i] = cached
        return cached

    def at(self, rows: Sequence[int], tokens: Sequence[int]) -> list[float]:
        """[norm(row r)(t) for r, t in zip(rows, tokens)] with one gather (bit-identical to row(r)[t])."""
        if not rows:
            return []
        totals = self.sums(rows)
        if len(rows) == 1:
            values = [float(self.raw[rows[0], tokens[0]].to(torch.float64) / totals[0])]
        else:
            device = self.raw.device
            r = torch.tensor(list(rows), dtype=torch.long, device=device)
            t = torch.tensor(list(tokens), dtype=torch.long, device=device)
            divisor = torch.tensor(totals, dtype=torch.float64, device=device)
            values = (self.raw[r, t].to(torch.float64) / divisor).tolist()
        if any(not v >= 0.0 for v in values):
            raise VerificationError(f"{self.name} rows {list(rows)} have negative or NaN entries")
        return values

    def positive_mass(self, other: Rows, start: int, stop: int, weights: Sequence[float]) -> list[float]:
        """[Σ_x (w_i·self_i(x) − other_i(x))+ for rows i = start..stop−1], self_i = norm(row i).

        One vectorised float64 pass over the [stop − start, V] block, done in place on a single
        buffer (no normalised copies of the rows are kept).
        """
        if stop <= start:
            return []
        rows = range(start, stop)
        device = self.raw.device
        own = torch.tensor(self.sums(rows), dtype=torch.float64, device=device)
        theirs = torch.tensor(other.sums(rows), dtype=torch.float64, device=device)
        w = torch.tensor(list(weights), dtype=torch.float64, device=device)
        # Two float64 buffers and in-place same-dtype ops: mixed-dtype kernels and fresh temporaries
        # are several times slower than the arithmetic itself at V ~ 150k.
        work = torch.empty((stop - start, self.vocab), dtype=torch.float64, device=device)
        work.copy_(self.raw[start:stop]).mul_((w / own)[:, None])
        theirs_rows = torch.empty_like(work).copy_(other.raw[start:stop])
        work.addcmul_(theirs_rows, (-1.0 / theirs)[:, None])
        return work.clamp_min_(0.0).sum(dim=1).tolist()


_NEEDS_SOURCE = {"token", "block", "gsd-tree", "rd"}


def needs_draft_probs(method: str, params: MethodParams | None = None) -> bool:
    """Whether `method` reads draft distributions (False for ERSD and for RD with a = 0)."""
    _check_method(method)
    if method == "ersd":
        return False
    if method == "rd":
        a = (params or MethodParams()).a
        rd.check_a(a)
        return a != 0.0
    return True


def verify(
    method: str,
    tree: DraftTree,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
    params: MethodParams | None = None,
    source: RandomSource | None = None,
) -> VerifyResult:
    """Run one verification of `tree` with `method` (see base.py for the row layout).

    `draft_probs` may be None for methods that need none (`needs_draft_probs`); `source` supplies
    every random draw and may be None only for ERSD, which is driven by position-keyed races.
    """
    params = params or MethodParams()
    _check_method(method)
    check_rows(tree, target_probs, "target")
    vocab = int(target_probs.shape[1])
    if vocab < 1:
        raise VerificationError("target distributions have an empty vocabulary")
    bad = [t for t in tree.tokens if not 0 <= t < vocab]
    if bad:
        raise VerificationError(f"draft tokens {bad} lie outside the vocabulary [0, {vocab})")
    target = Rows(target_probs, "target")
    draft: Rows | None = None
    if needs_draft_probs(method, params):
        check_rows(tree, draft_probs, "draft")
        assert draft_probs is not None
        if int(draft_probs.shape[1]) != vocab:
            raise VerificationError(
                f"draft vocabulary {int(draft_probs.shape[1])} differs from the target's {vocab}"
            )
        draft = Rows(draft_probs, "draft")
    if method in _NEEDS_SOURCE and source is None:
        raise VerificationError(f"method {method!r} needs a RandomSource")
    return _DISPATCH[method](tree, target, draft, params, source)


def _check_method(method: str) -> None:
    if method not in _DISPATCH:
        raise VerificationError(f"unknown verification method {method!r}; choose one of {', '.join(METHODS)}")


_DISPATCH: dict[str, Callable[..., VerifyResult]] = {
    "token": token.verify_token,
    "block": block.verify_block,
    "ersd": ersd.verify_ersd,
    "gsd-tree": gsd_tree.verify_gsd_tree,
    "rd": rd.verify_rd,
}
assert set(_DISPATCH) == set(METHODS)

"""The one entry point, `verify`, and the row view every method reads its distributions through.

`verify` validates what is common to all methods (known method, row shapes, token ids, source
present) and hands each method `Rows` views of the target and draft tensors. A `Rows` view reads
row i as norm(row i) in float64 — exactly the distribution the sampling side used — but does the
work lazily, row by row: the rejection methods read two scalars per position they visit and
materialise one or two rows (residual or bonus), so the cost follows the accepted length and one
call stays at a few milliseconds for a 150k vocabulary (bench/results/verification.md).
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
            if block.device.type == "cpu" and block.dtype in (torch.float32, torch.float64):
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
            gathered = [float(self.raw[rows[0], tokens[0]])]
        else:
            gathered = self.raw[list(rows), list(tokens)].tolist()
        # Python float division is IEEE float64 division, so each value equals row(r)[t] exactly.
        values = [v / total for v, total in zip(gathered, totals, strict=True)]
        if any(not v >= 0.0 for v in values):
            raise VerificationError(f"{self.name} rows {list(rows)} have negative or NaN entries")
        return values

    def positive_mass(self, other: Rows, start: int, stop: int, weights: Sequence[float]) -> list[float]:
        """[Σ_x (w_i·self_i(x) − other_i(x))+ for rows i = start..stop−1], self_i = norm(row i).

        Vectorised over the rows, in float64, in place on two work buffers. On the CPU the
        vocabulary is walked in column chunks of about 1 MiB per buffer: the passes then stay in
        cache, about twice as fast as one pass over the whole [rows, V] block (memory-bound).
        """
        if stop <= start:
            return []
        rows = range(start, stop)
        m = stop - start
        device = self.raw.device
        sums = zip(weights, self.sums(rows), other.sums(rows), strict=True)
        scales = [(w / own, -1.0 / theirs) for w, own, theirs in sums]
        own_scale, their_scale = torch.tensor(scales, dtype=torch.float64, device=device).T[:, :, None]
        vocab = self.vocab
        chunk = vocab if device.type != "cpu" else max(1024, _CPU_CHUNK_BYTES // (8 * m))
        work = torch.empty((m, min(chunk, vocab)), dtype=torch.float64, device=device)
        scratch = torch.empty_like(work)
        total = torch.zeros(m, dtype=torch.float64, device=device)
        for c0 in range(0, vocab, chunk):
            c1 = min(c0 + chunk, vocab)
            a, b = work[:, : c1 - c0], scratch[:, : c1 - c0]
            a.copy_(self.raw[start:stop, c0:c1]).mul_(own_scale)
            b.copy_(other.raw[start:stop, c0:c1])
            total += a.addcmul_(b, their_scale).clamp_min_(0.0).sum(dim=1)
        return total.tolist()


_CPU_CHUNK_BYTES = 1 << 20
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

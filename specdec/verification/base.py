"""What every verification method shares: its parameters, its result, the row view it reads, the
rejection test, the residual and the input checks (the methods import only this module).

Row layout of the distribution tensors (shape [n + 1, V] for a tree of n nodes):
  row 0      the distribution after the committed prefix (the root),
  row i + 1  the distribution after the path root → node i.
So the target rows cover every node plus "the node after each leaf" (the bonus token), and
`P_{k+1}` of a sequence of k drafts is row k. Draft rows follow the same layout; a method that
needs no draft distributions (ERSD) accepts `draft_probs=None`. Rows are the *warped*
distributions (specdec.sampling.warp_logits) of the request's sampling parameters.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from specdec.randomness import RandomSource
from specdec.sampling import row_argmax
from specdec.trees import DraftTree
from specdec.verification.errors import VerificationError

_CPU_CHUNK_BYTES = 1 << 20


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


def check_rows(tree: DraftTree, rows: object, name: str, vocab: int | None = None) -> torch.Tensor:
    """`rows` is a floating-point [n + 1, V] tensor for `tree` (V = `vocab` when given).

    The one check of a distribution tensor's form: the verifier engine runs it on what arrives
    before any forward pass, `verify` on what it is handed.
    """
    if rows is None:
        raise VerificationError(f"{name} distributions are required by this method")
    shape = tuple(rows.shape) if isinstance(rows, torch.Tensor) else None
    if shape is None or len(shape) != 2 or shape[0] != len(tree) + 1:
        want = f"[{len(tree) + 1}, {'V' if vocab is None else vocab}]"
        got = type(rows).__name__ if shape is None else str(shape)
        raise VerificationError(f"{name} distributions must have shape [n + 1, V] = {want}, got {got}")
    if vocab is not None and shape[1] != vocab:
        raise VerificationError(f"{name} vocabulary {shape[1]} differs from the target's {vocab}")
    if not rows.is_floating_point():
        raise VerificationError(f"{name} distributions must be floating point, got {rows.dtype}")
    return rows


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


def _has_drafts(tree: DraftTree, params: MethodParams) -> bool:
    return len(tree) > 0


def rejection_rule(
    method: str,
    *,
    sequences_only: bool = True,
    has_drafts: Callable[[DraftTree, MethodParams], bool] = _has_drafts,
) -> Callable[[RuleBody], Rule]:
    """The preamble the rejection rules (token, block, gsd-tree, RD) share, written once.

    The decorated rule checks the draft's shape (`sequences_only`), answers a step with nothing to
    check (`has_drafts` False: by default an empty tree; it may also run a rule's own parameter
    checks) by sampling the target's root row without reading a draft row, and hands its body the
    draft rows, which are then present (the registry's `needs_rows` says so).
    """

    def decorate(body: RuleBody) -> Rule:
        @functools.wraps(body)
        def rule(
            tree: DraftTree,
            target: Rows,
            draft: Rows | None,
            params: MethodParams,
            source: RandomSource,
        ) -> VerifyResult:
            if sequences_only:
                require_sequence(tree, method)
            if not has_drafts(tree, params):  # the step samples the target's row (no draft row is read)
                return VerifyResult([source.categorical(target.row(0))])
            assert draft is not None
            return body(tree, target, draft, params, source)

        return rule

    return decorate


def descend(tree: DraftTree, draw: Callable[[int, int], int]) -> VerifyResult:
    """Walk `tree` from the root: emit `draw(node, depth)` at each node and descend into the child
    carrying it; stop at a leaf or where no child matches. ERSD (races) and draw-and-descend (target
    samples) are this one walk with different draws, so it is written once.
    """
    node, depth = -1, 0
    tokens: list[int] = []
    accepted: list[int] = []
    flags: list[bool] = []
    while True:
        y = draw(node, depth)
        tokens.append(y)
        children = tree.children(node)
        if not children:
            break
        match = next((c for c in children if tree.tokens[c] == y), None)
        if match is None:
            flags.append(False)
            break
        flags.append(True)
        accepted.append(match)
        node, depth = match, depth + 1
    return VerifyResult(tokens, accepted, flags)


def greedy_descent(tree: DraftTree, logits: torch.Tensor) -> VerifyResult:
    """What a descend rule (ERSD's races, draw-and-descend; specdec.methods.DESCEND_RULES) emits on
    greedy rows, read from the raw target logits [n + 1, V]: at temperature 0 every warped row is
    one-hot at its argmax (specdec.sampling.greedy_one_hot), and a draw from a one-hot row is its
    one token whatever the race or the random source. So the walk reads each row's argmax without
    building the one-hot rows or scanning them: 0.2 ms instead of 7.8 ms for a 16-node draft on one
    EPYC thread (docs/algorithms.md §4)."""
    winners = row_argmax(logits).tolist()
    return descend(tree, lambda node, _depth: winners[node + 1])


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


# A rejection rule's body sees the draft rows present; the registered rule may be handed None.
RuleBody = Callable[[DraftTree, Rows, Rows, MethodParams, RandomSource], VerifyResult]
Rule = Callable[[DraftTree, Rows, "Rows | None", MethodParams, RandomSource], VerifyResult]

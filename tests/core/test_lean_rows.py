"""Lean draft rows (docs/algorithms.md §12): the LeanRows view, its checks, the registry's lean
methods, and exactness of lean verification with rows fetched on demand.

Exactness is shown as in test_fidelity_exact.py, by exact enumeration: every branch of every
draw runs the lean protocol (rows up front, then on each DraftRowsNeeded the source is rewound
to where verification began and the rule re-runs with the rows added) and, on the same draws,
the full rows; the two must decide identically in every branch, and the law of the output must
be the target's to 1e-12. A lean form with one perturbed node value must fail the same check.
"""

from __future__ import annotations

import math

import pytest
import torch

from specdec.methods import METHODS, get_method
from specdec.trees import DraftTree
from specdec.verification.base import MethodParams, Rows
from specdec.verification.errors import VerificationError
from specdec.verification.lean import DraftRowsNeeded, LeanDraft, LeanRows, check_lean, token_probs

from .helpers_fidelity import TOLERANCE, fidelity_error, sequence_shape
from .helpers_lean import LeanVerifier, lean_form
from .helpers_toy_models import SAMPLING_VARIANTS

VARIANTS = list(SAMPLING_VARIANTS)


def _rows(n: int, vocab: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.rand(n, vocab, generator=generator, dtype=torch.float32) ** 3  # unnormalised rows


# --- the view -------------------------------------------------------------------------------------


def test_lean_rows_read_carried_rows_and_node_values_bit_for_bit() -> None:
    tree = DraftTree((5, 9, 2, 7), (-1, 0, 0, 1))  # rows 0..4; row 1 has two children
    raw = _rows(5, 50_000)
    full = Rows(raw, "draft")
    lean = LeanRows(tree, lean_form(tree, raw, {1, 4}), 50_000)
    for parent, token in zip(tree.parents, tree.tokens, strict=True):  # node values, one by one
        assert lean.at([parent + 1], [token]) == full.at([parent + 1], [token])
    assert lean.at([1, 4, 1], [3, 3, 9]) == full.at([1, 4, 1], [3, 3, 9])  # carried rows, any token
    assert lean.sums([4, 1]) == full.sums([4, 1])
    assert torch.equal(lean.row(1), full.row(1)) and torch.equal(lean.row(4), full.row(4))
    assert (len(lean), lean.vocab, lean.name) == (5, 50_000, "draft")
    # As the `other` side of block's positive mass (rows 1..2 carried or not).
    target = Rows(_rows(5, 50_000, seed=1), "target")
    assert target.positive_mass(lean, 1, 2, [0.7]) == target.positive_mass(full, 1, 2, [0.7])
    with pytest.raises(DraftRowsNeeded) as missing:
        target.positive_mass(lean, 1, 4, [0.7, 0.5, 0.2])
    assert missing.value.rows == (2, 3)


def test_lean_rows_ask_for_what_they_do_not_carry() -> None:
    tree = DraftTree.sequence([3, 1, 4])
    raw = _rows(4, 10)
    lean = LeanRows(tree, lean_form(tree, raw), 10)
    assert lean.at([0, 1, 2], [3, 1, 4]) == token_probs(tree, raw)
    for read, rows in [(lambda: lean.at([0], [2]), (0,)), (lambda: lean.at([2, 0, 1], [4, 3, 0]), (1,)),
                       (lambda: lean.row(3), (3,)), (lambda: lean.sums([2, 0, 2]), (0, 2))]:
        with pytest.raises(DraftRowsNeeded) as need:
            read()
        assert need.value.rows == rows
    assert not isinstance(DraftRowsNeeded([1]), VerificationError)  # not a bad request (INVALID_ARGUMENT)


def test_token_probs_are_what_rows_at_reads() -> None:
    tree = DraftTree((5, 9, 2), (-1, -1, 1))
    raw = _rows(4, 20)
    rows = Rows(raw, "draft")
    assert token_probs(tree, raw) == [rows.at([0], [5])[0], rows.at([0], [9])[0], rows.at([2], [2])[0]]


@pytest.mark.parametrize(("lean", "vocab", "message"), [
    (LeanDraft((0.5,)), None, "1 values for 2 tree nodes"),
    (LeanDraft((0.5, math.nan)), None, "finite and >= 0"),
    (LeanDraft((0.5, -0.1)), None, "finite and >= 0"),
    (LeanDraft((0.5, math.inf)), None, "finite and >= 0"),
    (LeanDraft((0.5, 0.5), (3,), torch.ones(1, 4)), None, r"outside the rows \[0, 3\)"),
    (LeanDraft((0.5, 0.5), (-1,), torch.ones(1, 4)), None, "outside"),
    (LeanDraft((0.5, 0.5), (1, 1), torch.ones(2, 4)), None, "repeat"),
    (LeanDraft((0.5, 0.5), (1,)), None, "missing"),
    (LeanDraft((0.5, 0.5), (1,), torch.ones(2, 4)), None, r"shape \[1, V\]"),
    (LeanDraft((0.5, 0.5), (1,), torch.ones(4)), None, "shape"),
    (LeanDraft((0.5, 0.5), (1,), torch.ones(1, 4)), 5, r"shape \[1, 5\]"),
    (LeanDraft((0.5, 0.5), (1,), torch.ones(1, 4, dtype=torch.int32)), 4, "floating point"),
])
def test_check_lean_refuses_malformed_forms(lean: LeanDraft, vocab: int | None, message: str) -> None:
    with pytest.raises(VerificationError, match=message):
        check_lean(2, lean, vocab)


def test_check_lean_accepts_well_formed_forms() -> None:
    assert check_lean(0, LeanDraft(())) == LeanDraft(())
    form = LeanDraft((0.25, 0.0), (2, 0), torch.ones(2, 4))
    assert check_lean(2, form, 4) is form


# --- the registry ---------------------------------------------------------------------------------


def test_lean_methods_and_the_rows_they_read_up_front() -> None:
    assert {name for name, m in METHODS.items() if m.lean_rows} == {"token", "rd", "gsd-tree"}
    rd, token = get_method("rd"), get_method("token")
    params = MethodParams(a=0.5, k_max=3)
    assert [rd.rows_up_front(params, k) for k in range(4)] == [(0,), (1,), (2,), ()]  # the tails row K
    assert rd.rows_up_front(MethodParams(a=0.0, k_max=3), 0) == ()  # a = 0 reads no draft row
    assert token.rows_up_front(params, 2) == () and get_method("gsd-tree").rows_up_front(params, 4) == ()


# --- exactness by enumeration ---------------------------------------------------------------------


def _lean_error(method: str, shape: tuple[int, ...], order: int, variant: str, **kw) -> tuple[float, int]:
    lean = LeanVerifier()
    error = fidelity_error(method, shape, order, variant, verify_fn=lean, **kw)
    return error, lean.retries


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("order", [1, 2])
def test_lean_token_is_exact(order: int, variant: str) -> None:
    error, retries = _lean_error("token", sequence_shape(2), order, variant)
    assert error < TOLERANCE
    assert retries > 0 or variant == "T=0"  # rejections were met (greedy drafts of another model too)


RD_LEAN = [(0.5, 1), (0.5, 2), (0.5, 3), (0.3, 2), (1.0, 2), (0.0, 2)]  # K < k_max and K = k_max


@pytest.mark.parametrize("variant", ["T=1", "T=0.7,top-k=3"])
@pytest.mark.parametrize(("a", "k_max"), RD_LEAN)
def test_lean_rd_is_exact(a: float, k_max: int, variant: str) -> None:
    error, retries = _lean_error("rd", (), 1, variant, a=a, k_max=k_max)
    assert error < TOLERANCE
    assert retries > 0 or a in (0.0, 1.0) or k_max == 1  # at K = k_max a rejection needs a retry


@pytest.mark.parametrize("variant", ["T=1", "top-p=0.8"])
@pytest.mark.parametrize("shape", [(-1, -1, -1), (-1, -1, 0), (-1, 0)], ids=["star3", "two-level", "seq2"])
def test_lean_gsd_tree_is_exact(shape: tuple[int, ...], variant: str) -> None:
    error, retries = _lean_error("gsd-tree", shape, 1, variant)
    assert error < TOLERANCE and retries > 0


def test_lean_block_is_exact_too() -> None:
    """Block is not a lean method (it would fetch rows 1..live a round trip later), but the view
    serves it exactly all the same: its positive mass reads the draft rows as `other`."""
    error, retries = _lean_error("block", sequence_shape(3), 1, "T=1")
    assert error < TOLERANCE and retries > 0


@pytest.mark.parametrize("method", ["token", "gsd-tree", "rd"])
def test_a_perturbed_node_value_is_caught(method: str) -> None:
    """The lean form's q must be the drafter's: halving the first node's breaks the output law."""
    broken = LeanVerifier(check_full=False, perturb=lambda q: [v / 2 for v in q[:1]] + q[1:])
    kwargs = {"a": 0.5, "k_max": 2} if method == "rd" else {}
    assert fidelity_error(method, sequence_shape(2), 1, "T=1", verify_fn=broken, **kwargs) > 1e-3

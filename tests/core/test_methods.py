"""The method registry: each record's predicates, the lookups, and that the table stays light."""

from __future__ import annotations

import subprocess
import sys

import pytest

from specdec.methods import (
    METHOD_NAMES,
    METHODS,
    SPECULATIVE_METHOD_NAMES,
    get_method,
    verification_method,
)
from specdec.verification.base import MethodParams, VerificationError


def test_names_and_order() -> None:
    assert METHOD_NAMES == ("token", "block", "ersd", "gsd-tree", "rd", "autoregressive")
    assert SPECULATIVE_METHOD_NAMES == METHOD_NAMES[:-1]


def test_needs_rows_per_method() -> None:
    plain, rd_half, rd_zero = MethodParams(), MethodParams(a=0.5, k_max=2), MethodParams(a=0.0, k_max=2)
    assert get_method("token").needs_rows(plain, 2)
    assert get_method("block").needs_rows(plain, 2)
    assert get_method("gsd-tree").needs_rows(plain, 3)
    assert not get_method("ersd").needs_rows(plain, 2)
    assert get_method("rd").needs_rows(rd_half, 2)
    assert not get_method("rd").needs_rows(rd_zero, 0)  # a = 0 never drafts
    # An empty tree samples P_1 alone, except RD's no-draft step, which needs Q_1.
    assert not get_method("token").needs_rows(plain, 0)
    assert get_method("rd").needs_rows(rd_half, 0)
    with pytest.raises(VerificationError, match="a must lie"):
        get_method("rd").needs_rows(MethodParams(a=1.5), 1)


def test_capabilities() -> None:
    assert {n for n, m in METHODS.items() if m.pipelinable} == {"token", "block", "ersd", "rd"}
    # Growing pre-drafts are exact only where the decision at position i reads drafts up to i.
    assert {n for n, m in METHODS.items() if m.adaptive_length} == {"token", "ersd"}
    assert {n for n, m in METHODS.items() if m.draft_strategy == "race"} == {"ersd"}
    assert {n for n, m in METHODS.items() if m.drafts_trees} == {"ersd", "gsd-tree"}
    assert {n: m.drafting for n, m in METHODS.items()} == {
        "token": "sequence", "block": "sequence", "ersd": "sequence", "gsd-tree": "tree", "rd": "coins",
        "autoregressive": "none"}
    assert {n for n, m in METHODS.items() if m.takes_a} == {"rd"}
    assert {n for n, m in METHODS.items() if m.k_is_tree_budget} == {"gsd-tree"}
    assert {n for n, m in METHODS.items() if m.needs_random_source} == {"token", "block", "gsd-tree", "rd"}
    for method in METHODS.values():
        assert method.speculative == (method.draft_strategy is not None) == bool(method.draft_shapes)
        assert method.speculative == (method.drafting != "none")
        assert method.pipelinable or not method.adaptive_length


def test_every_rule_resolves_to_its_module() -> None:
    for name in SPECULATIVE_METHOD_NAMES:
        rule = get_method(name).verify
        assert rule.__module__ == "specdec.verification." + name.replace("-", "_")


def test_lookups_name_the_choices() -> None:
    with pytest.raises(VerificationError, match="unknown method 'nope'; choose one of token, block"):
        get_method("nope")
    with pytest.raises(VerificationError, match="verifies no drafts"):
        verification_method("autoregressive")
    with pytest.raises(VerificationError, match="verifies no drafts"):
        _ = get_method("autoregressive").verify


def test_the_table_imports_without_torch() -> None:
    """The CLI reads it for --help and choices: it must not pay for torch."""
    code = "import sys, specdec.methods\nassert 'torch' not in sys.modules, 'torch imported'\n"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr

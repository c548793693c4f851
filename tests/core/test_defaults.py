"""The built-in defaults: the fast precision per device and the specdec home."""

from __future__ import annotations

from pathlib import Path

import pytest

from specdec.defaults import AUTO_PRECISION, PRECISIONS, fast_precision, resolve_precision, specdec_home


@pytest.mark.parametrize(
    ("device", "precision"),
    [("cpu", "int8"), ("CPU", "int8"), ("cuda", "bfloat16"), ("cuda:1", "bfloat16"), ("mps", "float32")],
)
def test_fast_precision_per_device(device: str, precision: str) -> None:
    assert fast_precision(device) == precision
    assert resolve_precision(AUTO_PRECISION, device) == precision


def test_an_explicit_precision_wins_and_a_bad_one_names_the_choices() -> None:
    for precision in PRECISIONS:
        assert resolve_precision(precision, "cpu") == precision
    with pytest.raises(ValueError, match="auto, float32, bfloat16, float16, int8"):
        resolve_precision("int4", "cpu")


def test_specdec_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "h"))
    assert specdec_home() == tmp_path / "h"
    assert specdec_home(tmp_path / "given") == tmp_path / "given"
    monkeypatch.delenv("SPECDEC_HOME")
    assert specdec_home() == Path.home() / ".cache" / "specdec"
